//! `loadtest send` to a gateway served over HTTPS with a certificate the platform does not
//! trust (on the embedded mock cluster): with `--ca-file` every batch is acknowledged; without,
//! nothing is, and the run goes on retrying until it is stopped.

use std::time::Duration;

use ingest_gateway::config::{AuthConfig, GatewayConfig, TlsConfig};
use loadtest::fleet::FleetSpec;
use loadtest::send::{SendOptions, SendSummary};
use rdkafka::mocking::MockCluster;
use tokio_util::sync::CancellationToken;

async fn send(
    gateway: &str,
    ca_file: Option<std::path::PathBuf>,
    stop_after: Duration,
) -> SendSummary {
    let shutdown = CancellationToken::new();
    let stopper = shutdown.clone();
    tokio::spawn(async move {
        tokio::time::sleep(stop_after).await;
        stopper.cancel();
    });
    loadtest::send::run(
        SendOptions {
            gateway: gateway.to_owned(),
            token: None,
            ca_file,
            fleet: FleetSpec {
                records: 600,
                devices: 6,
                ..FleetSpec::default()
            },
            batch_records: 100,
            encoding: edge_agent::batch::BodyEncoding::Ndjson,
            concurrency: 2,
            rate: 0.0,
            save: None,
            timeout: Duration::from_secs(5),
        },
        shutdown,
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_trusts_the_ca_file_it_is_given() {
    let cluster = MockCluster::new(1).unwrap();
    cluster
        .create_topic("ingest.sensor_readings", 3, 1)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
    let mut config = GatewayConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        auth: AuthConfig {
            allow_anonymous: true,
            tokens: Vec::new(),
        },
        tls: Some(TlsConfig {
            cert: cert_path.clone(),
            key: key_path,
        }),
        ..GatewayConfig::default()
    };
    config.kafka.brokers = cluster.bootstrap_servers();
    let shutdown = CancellationToken::new();
    let gateway = ingest_gateway::start(config, schemas::example_streams(), shutdown.clone())
        .await
        .unwrap();
    let url = format!("https://localhost:{}", gateway.addr.port());
    // The platform's roots: every attempt fails the handshake, and is retried until the stop.
    let untrusted = send(&url, None, Duration::from_secs(2)).await;
    assert!(untrusted.interrupted, "{untrusted:?}");
    assert_eq!(untrusted.batches, 0, "{untrusted:?}");
    let trusted = send(&url, Some(cert_path), Duration::from_secs(60)).await;
    assert!(!trusted.interrupted, "{trusted:?}");
    assert_eq!(
        (trusted.batches, trusted.refused_batches),
        (6, 0),
        "{trusted:?}"
    );
    assert_eq!(trusted.accepted + trusted.duplicates, 600, "{trusted:?}");
    shutdown.cancel();
    gateway.task.await.unwrap().unwrap();
}
