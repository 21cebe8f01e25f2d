//! `loadtest send` to a gateway served over HTTPS with a certificate the platform does not
//! trust (on the embedded mock cluster): with `--ca-file` every batch is acknowledged; without,
//! nothing is, and the run goes on retrying until it is stopped. And a gateway that requires
//! client certificates (`[tls] client_ca_file`): only a sender presenting one gets through.

use std::path::{Path, PathBuf};
use std::time::Duration;

use edge_agent::tls::TlsFiles;
use ingest_gateway::config::{AuthConfig, GatewayConfig, TlsConfig};
use loadtest::fleet::FleetSpec;
use loadtest::send::{SendOptions, SendSummary};
use rdkafka::mocking::MockCluster;
use tokio_util::sync::CancellationToken;

async fn send(gateway: &str, tls: TlsFiles, stop_after: Duration) -> SendSummary {
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
            tls,
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

/// A self-signed certificate for `name` and its key, as PEM files `<name>.pem` and
/// `<name>-key.pem` in `dir`.
fn certificate(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let made = rcgen::generate_simple_self_signed(vec![name.into()]).unwrap();
    let (cert, key) = (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}-key.pem")),
    );
    std::fs::write(&cert, made.cert.pem()).unwrap();
    std::fs::write(&key, made.signing_key.serialize_pem()).unwrap();
    (cert, key)
}

/// A gateway on a mock cluster, over HTTPS with `tls`; returns its https://localhost url.
async fn gateway(
    tls: TlsConfig,
    shutdown: &CancellationToken,
) -> (
    String,
    ingest_gateway::Gateway,
    MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
) {
    let cluster = MockCluster::new(1).unwrap();
    cluster
        .create_topic("ingest.sensor_readings", 3, 1)
        .unwrap();
    let mut config = GatewayConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        admin_listen: None,
        auth: AuthConfig {
            allow_anonymous: true,
            tokens: Vec::new(),
        },
        tls: Some(tls),
        ..GatewayConfig::default()
    };
    config.kafka.brokers = cluster.bootstrap_servers();
    let gateway = ingest_gateway::start(config, schemas::example_streams(), shutdown.clone())
        .await
        .unwrap();
    let url = format!("https://localhost:{}", gateway.addr.port());
    (url, gateway, cluster)
}

fn assert_all_acknowledged(summary: &SendSummary) {
    assert!(!summary.interrupted, "{summary:?}");
    assert_eq!(
        (summary.batches, summary.refused_batches),
        (6, 0),
        "{summary:?}"
    );
    assert_eq!(summary.accepted + summary.duplicates, 600, "{summary:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_trusts_the_ca_file_it_is_given() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = certificate(dir.path(), "localhost");
    let shutdown = CancellationToken::new();
    let tls = TlsConfig {
        cert: cert.clone(),
        key,
        client_ca_file: None,
    };
    let (url, gateway, _cluster) = gateway(tls, &shutdown).await;
    // The platform's roots: every attempt fails the handshake, and is retried until the stop.
    let untrusted = send(&url, TlsFiles::default(), Duration::from_secs(2)).await;
    assert!(untrusted.interrupted, "{untrusted:?}");
    assert_eq!(untrusted.batches, 0, "{untrusted:?}");
    let trusted = TlsFiles {
        ca_file: Some(cert),
        ..TlsFiles::default()
    };
    assert_all_acknowledged(&send(&url, trusted, Duration::from_secs(60)).await);
    shutdown.cancel();
    gateway.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_requiring_client_certificates_takes_only_senders_with_one() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = certificate(dir.path(), "localhost");
    // The client's certificate is its own CA here; a site would sign its boxes' with one CA.
    let (client_cert, client_key) = certificate(dir.path(), "edge-box-7");
    let (other_cert, other_key) = certificate(dir.path(), "stranger");
    let shutdown = CancellationToken::new();
    let tls = TlsConfig {
        cert: cert.clone(),
        key,
        client_ca_file: Some(client_cert.clone()),
    };
    let (url, gateway, _cluster) = gateway(tls, &shutdown).await;
    let trusting = |client_cert: Option<PathBuf>, client_key: Option<PathBuf>| TlsFiles {
        ca_file: Some(cert.clone()),
        client_cert,
        client_key,
    };
    for (name, tls) in [
        ("no client certificate", trusting(None, None)),
        (
            "a certificate of another CA",
            trusting(Some(other_cert), Some(other_key)),
        ),
    ] {
        let refused = send(&url, tls, Duration::from_secs(2)).await;
        assert!(refused.interrupted, "{name}: {refused:?}");
        assert_eq!(refused.batches, 0, "{name}: {refused:?}");
    }
    let accepted = send(
        &url,
        trusting(Some(client_cert), Some(client_key)),
        Duration::from_secs(60),
    )
    .await;
    assert_all_acknowledged(&accepted);
    shutdown.cancel();
    gateway.task.await.unwrap().unwrap();
}
