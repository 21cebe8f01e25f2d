//! The agent over TLS, with certificates from a CA made for the test: subscribing to mosquitto
//! on a TLS listener that requires a client certificate, and delivering to a gateway served over
//! HTTPS that requires one too. Without the site's CA, or without the client certificate, the
//! connection is refused and nothing lands.

use crate::support;

use std::time::{Duration, Instant};

use support::pki::{Pki, pki};
use support::{
    Faults, KillOnDrop, Stub, assert_exactly_once, config, free_port, mqtt_publish, readings,
    service_env, start, wait_landed,
};

/// A `tls` table with the CA and, if `client`, the client certificate.
fn tls_table(pki: &Pki, client: bool) -> String {
    let client = if client {
        format!(
            ", client_cert = {:?}, client_key = {:?}",
            pki.client_cert, pki.client_key
        )
    } else {
        String::new()
    };
    format!("{{ ca_file = {:?}{client} }}", pki.ca)
}

/// Runs an agent on `cfg` for three seconds while `feed` gives it records, then stops it:
/// nothing may have landed.
async fn assert_nothing_lands(stub: &Stub, cfg: &str, feed: impl Future<Output = ()>) {
    let (agent, shutdown) = start(cfg);
    let _ = tokio::time::timeout(Duration::from_secs(3), feed).await;
    assert_eq!(
        stub.landed_total(),
        0,
        "landed without a trusted connection"
    );
    shutdown.cancel();
    // The open batch may not reach the spool's receiver: the agent stops regardless.
    let _ = tokio::time::timeout(Duration::from_secs(10), agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_over_tls_with_a_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    // A broker of its own: a plain listener for the test's publisher and a TLS one, requiring a
    // client certificate from the CA, for the agent.
    let (plain, secure) = (free_port(), free_port());
    let conf = dir.path().join("mosquitto.conf");
    std::fs::write(
        &conf,
        format!(
            "allow_anonymous true\npersistence false\nlistener {plain} 127.0.0.1\n\
             listener {secure} 127.0.0.1\ncafile {}\ncertfile {}\nkeyfile {}\n\
             require_certificate true\n",
            pki.ca.display(),
            pki.server_cert.display(),
            pki.server_key.display()
        ),
    )
    .unwrap();
    let _broker = KillOnDrop(
        std::process::Command::new(service_env("EDGE_INGEST_MOSQUITTO"))
            .arg("-c")
            .arg(&conf)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("mosquitto.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    for port in [plain, secure] {
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "mosquitto did not open {port}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let publisher = format!("127.0.0.1:{plain}");
    let stub = Stub::start(Faults::default()).await;
    let source = |tls: &str, id: &str| {
        config(
            &dir.path().join(id),
            &stub.url(),
            "[batch]\nmax_age_ms = 200\n",
            &format!(
                "[[sources]]\ntype = \"mqtt\"\nurl = \"mqtts://127.0.0.1:{secure}\"\n\
                 topics = [\"tls-test/readings\"]\nstream = \"sensor_readings\"\n\
                 client_id = \"{id}\"\nqos = 1\ntls = {tls}\n"
            ),
        )
    };
    let (lines, expected) = readings(200, 4, 0, 21);
    let messages: Vec<String> = lines.chunks(4).map(|c| c.join("\n")).collect();
    // The first message, again and again: a connected agent would receive it.
    let first_again = || async {
        loop {
            let first = messages[..1].to_vec();
            mqtt_publish(&publisher, "tls-test/readings", first, Duration::ZERO).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    };
    // Refused: no client certificate; and the platform's roots do not know the site's CA.
    let no_client_cert = source(&tls_table(&pki, false), "no-client-cert");
    assert_nothing_lands(&stub, &no_client_cert, first_again()).await;
    assert_nothing_lands(&stub, &source("{}", "platform-roots"), first_again()).await;
    let (agent, shutdown) = start(&source(&tls_table(&pki, true), "edge-box-7"));
    // The subscription must exist before the rest is published: the first message again until
    // something lands (the window drops the copies).
    let landed = async {
        while stub.landed_total() == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::select! {
        _ = landed => {}
        _ = first_again() => unreachable!(),
        _ = tokio::time::sleep(Duration::from_secs(20)) => panic!(
            "nothing arrived over TLS:\n{}",
            std::fs::read_to_string(dir.path().join("mosquitto.log")).unwrap()
        ),
    }
    mqtt_publish(
        &publisher,
        "tls-test/readings",
        messages[1..].to_vec(),
        Duration::ZERO,
    )
    .await;
    wait_landed(&stub, expected.len()).await;
    shutdown.cancel();
    agent.await.unwrap().unwrap();
    assert_exactly_once(&stub.landed(), &expected);
}

/// A server config for the stub, as the gateway makes it from its `[tls]`: the server
/// certificate, and client certificates required and checked against the CA.
fn gateway_tls(pki: &Pki) -> rustls::ServerConfig {
    service_kit::http::server::TlsConfig {
        cert: pki.server_cert.clone(),
        key: pki.server_key.clone(),
        client_ca_file: Some(pki.ca.clone()),
    }
    .server_config()
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivers_over_https_with_the_sites_ca_and_a_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let stub = Stub::start_tls(Faults::default(), gateway_tls(&pki)).await;
    let (lines, expected) = readings(500, 5, 0, 23);
    let input = dir.path().join("r.ndjson");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let agent = |tls: &str, id: &str| {
        config(
            &dir.path().join(id),
            &stub.url(),
            &format!("tls = {tls}\n[batch]\nmax_records = 100\n"),
            &support::file_source_toml(&input, "follow = true\n"),
        )
    };
    // The input is there to be read: a connected agent would deliver it.
    let no_client_cert = agent(&tls_table(&pki, false), "no-client-cert");
    assert_nothing_lands(&stub, &no_client_cert, std::future::pending()).await;
    assert_nothing_lands(
        &stub,
        &agent("{}", "platform-roots"),
        std::future::pending(),
    )
    .await;
    let (running, shutdown) = start(&agent(&tls_table(&pki, true), "edge-box-7"));
    wait_landed(&stub, expected.len()).await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    assert_exactly_once(&stub.landed(), &expected);
}

/// Through a forward proxy (tests/proxy.rs) an `https://` gateway is reached by a `CONNECT`
/// tunnel: TLS, with the site's CA and the client certificate, still ends at the gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivers_over_https_through_a_proxys_tunnel() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let proxy = support::Proxy::start(dir.path(), Some(("edge", "s3cret"))).await;
    let stub = Stub::start_tls(Faults::default(), gateway_tls(&pki)).await;
    let (lines, expected) = readings(300, 5, 0, 41);
    let input = dir.path().join("r.ndjson");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let cfg = config(
        &dir.path().join("state"),
        &stub.url(),
        &format!(
            "tls = {}\n[gateway.proxy]\nurl = \"{}\"\nusername = \"edge\"\npassword = \"s3cret\"\n\
             [batch]\nmax_records = 100\n",
            tls_table(&pki, true),
            proxy.url
        ),
        &support::file_source_toml(&input, "follow = true\n"),
    );
    let (running, shutdown) = start(&cfg);
    wait_landed(&stub, expected.len()).await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    assert_exactly_once(&stub.landed(), &expected);
    let tunnel = format!("CONNECT {} HTTP/1.1", stub.addr);
    assert!(
        proxy.log().contains(&tunnel),
        "no tunnel to the gateway in the proxy's log:\n{}",
        proxy.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_port_serves_https_and_requires_client_certificates_from_its_ca() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let stub = Stub::start(Faults::default()).await;
    let port = free_port();
    let cfg = support::http_source_config(
        dir.path(),
        &stub.url(),
        port,
        &format!(
            "tls = {{ cert = {:?}, key = {:?}, client_ca_file = {:?} }}\n",
            pki.server_cert, pki.server_key, pki.ca
        ),
    );
    let (agent, shutdown) = start(&cfg);
    let ca = reqwest::Certificate::from_pem(&std::fs::read(&pki.ca).unwrap()).unwrap();
    let mut identity = std::fs::read(&pki.client_cert).unwrap();
    identity.extend(std::fs::read(&pki.client_key).unwrap());
    let client = reqwest::Client::builder()
        .tls_certs_only([ca.clone()])
        .identity(reqwest::Identity::from_pem(&identity).unwrap())
        .build()
        .unwrap();
    let (lines, expected) = readings(50, 5, 0, 29);
    let url = format!("https://127.0.0.1:{port}/v1/streams/sensor_readings/records");
    let deadline = Instant::now() + Duration::from_secs(20);
    let answer = loop {
        let request = client
            .post(&url)
            .header("content-type", "application/x-ndjson")
            .body(lines.join("\n"));
        match request.send().await {
            Ok(answer) => break answer,
            Err(e) => assert!(Instant::now() < deadline, "no HTTPS answer: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(answer.status(), 200);
    // A client that trusts the port but has no client certificate gets no TLS session.
    let anonymous = reqwest::Client::builder()
        .tls_certs_only([ca])
        .build()
        .unwrap()
        .post(&url)
        .header("content-type", "application/x-ndjson")
        .body(lines.join("\n"))
        .send()
        .await;
    assert!(anonymous.is_err(), "{anonymous:?}");
    // Plain HTTP gets no answer from a TLS port.
    let plain = reqwest::get(format!("http://127.0.0.1:{port}/")).await;
    assert!(plain.is_err(), "{plain:?}");
    wait_landed(&stub, expected.len()).await;
    shutdown.cancel();
    agent.await.unwrap().unwrap();
    assert_exactly_once(&stub.landed(), &expected);
}
