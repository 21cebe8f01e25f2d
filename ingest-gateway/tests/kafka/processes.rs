//! The gateway as a process: SIGKILL at random points, SIGHUP reloads, definition changes, slow uplinks.

use super::*;

/// The gateway process SIGKILLed at random points while clients post batches and retry each
/// until it is answered 200, as agents do: every record of every acknowledged batch is in Kafka,
/// because the gateway answers only once Kafka acknowledged all of a request's records. A batch
/// whose answer a kill cut off is produced again when retried (the new process does not know its
/// Idempotency-Key), so records may be in Kafka twice, at most the batches in flight at each
/// kill; the sink drops them by content hash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_random_points_loses_no_acknowledged_record() {
    use rand::Rng;
    const BATCHES: i64 = 400;
    const PER_BATCH: i64 = 150;
    const CLIENTS: usize = 4;
    let brokers = env("EDGE_INGEST_KAFKA");
    let port = free_port();
    let id = unique();
    let prefix = format!("gwkill{id}.");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("gateway.toml");
    std::fs::write(
        &config,
        gateway_toml(
            port,
            &brokers,
            &prefix,
            &format!("gwkill{id}-dead-letters"),
            "",
        ),
    )
    .unwrap();
    let mut runs = 1;
    let mut gateway = spawn_gateway(&config, port, &dir.path().join("gateway-1.log")).await;
    let url = format!("http://127.0.0.1:{port}/v1/streams/sensor_readings/records");
    // Clients take the next batch, and post it until it is answered 200.
    let next = std::sync::Arc::new(AtomicU64::new(0));
    let retries = std::sync::Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (next, retries, url) = (next.clone(), retries.clone(), url.clone());
            tokio::spawn(async move {
                let client = reqwest::Client::builder()
                    .timeout(Duration::from_secs(15))
                    .build()
                    .unwrap();
                loop {
                    let b = next.fetch_add(1, Ordering::Relaxed) as i64;
                    if b >= BATCHES {
                        return;
                    }
                    let records: Vec<Value> =
                        (b * PER_BATCH..(b + 1) * PER_BATCH).map(reading).collect();
                    let key = format!("batch-{b}");
                    // Paced, so that the run outlasts several kills.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    loop {
                        match try_post(&client, &url, ndjson(&records), Some(&key)).await {
                            Ok(r) if r.status() == 200 => break,
                            Ok(r) => assert!(
                                r.status().is_server_error() || r.status() == 429,
                                "batch {b}: {}",
                                r.status()
                            ),
                            Err(_) => {}
                        }
                        retries.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            })
        })
        .collect();
    let mut kills = 0;
    while !clients.iter().all(|c| c.is_finished()) {
        let wait = rand::rng().random_range(100..700);
        tokio::time::sleep(Duration::from_millis(wait)).await;
        if kills == 6 || clients.iter().all(|c| c.is_finished()) {
            continue;
        }
        gateway.kill().unwrap();
        gateway.wait().unwrap();
        kills += 1;
        let down = rand::rng().random_range(50..500);
        tokio::time::sleep(Duration::from_millis(down)).await;
        runs += 1;
        let log = dir.path().join(format!("gateway-{runs}.log"));
        gateway = spawn_gateway(&config, port, &log).await;
    }
    for c in clients {
        c.await.unwrap();
    }
    gateway.kill().unwrap();
    gateway.wait().unwrap();
    assert!(
        kills >= 3,
        "only {kills} kills: the run was too short to test anything"
    );
    let total = (BATCHES * PER_BATCH) as usize;
    let def = schemas::example_streams()
        .get("sensor_readings")
        .unwrap()
        .clone();
    let mut landed: HashMap<String, u32> = HashMap::new();
    for (payload, _) in consume(&brokers, &format!("{prefix}sensor_readings"), total) {
        let record = schemas::wire::decode_value(&def, &payload).unwrap();
        *landed
            .entry(schemas::content_hash(&def, &record).to_hex())
            .or_default() += 1;
    }
    let missing = (0..BATCHES * PER_BATCH)
        .filter(|i| {
            let valid = schemas::check(&def, reading(*i)).unwrap();
            !landed.contains_key(&valid.hash.to_hex())
        })
        .count();
    let again: u32 = landed.values().map(|n| n - 1).sum();
    eprintln!(
        "{kills} kills over {runs} runs; {} retried posts; {again} records produced again",
        retries.load(Ordering::Relaxed)
    );
    assert_eq!(missing, 0, "{missing} of {total} acknowledged records lost");
    assert_eq!(landed.len(), total, "records that were never sent");
    assert!(
        again as i64 <= kills as i64 * CLIENTS as i64 * PER_BATCH,
        "{again} records produced again: more than the batches in flight at the kills"
    );
}

/// SIGHUP puts the config file's tokens and certificate in force without a restart: a token
/// added works and one removed no longer does, and new connections get the new certificate. A
/// config that does not load changes nothing. Before, SIGHUP ended the gateway, and a leaked
/// token or a renewed certificate took a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_tokens_and_the_certificate() {
    let brokers = env("EDGE_INGEST_KAFKA");
    let port = free_port();
    let id = unique();
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    let config = dir.path().join("gateway.toml");
    let write = |certified: &rcgen::CertifiedKey<rcgen::KeyPair>, token_hash: &str| {
        std::fs::write(&cert, certified.cert.pem()).unwrap();
        std::fs::write(&key, certified.signing_key.serialize_pem()).unwrap();
        std::fs::write(
            &config,
            format!(
                "listen = \"127.0.0.1:{port}\"\nadmin_listen = \"api\"\nstreams_dir = {streams:?}\n\
                 [tls]\ncert = {cert:?}\nkey = {key:?}\n\
                 [kafka]\nbrokers = \"{brokers}\"\ntopic_prefix = \"hup{id}.\"\n\
                 create_topics = true\ndead_letter_topic = \"hup{id}-dead-letters\"\n\
                 [[auth.tokens]]\nname = \"device\"\nblake3 = \"{token_hash}\"\nstreams = [\"*\"]\n",
                streams = Path::new(env!("CARGO_MANIFEST_DIR")).join("../streams"),
            ),
        )
        .unwrap();
    };
    let hash = |token: &str| blake3::hash(token.as_bytes()).to_hex().to_string();
    let localhost = || rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let (first, second) = (localhost(), localhost());
    write(&first, &hash(TOKEN));
    let log = dir.path().join("gateway.log");
    let mut gateway = spawn_gateway(&config, port, &log).await;
    // A client of its own per check: a new connection, which gets the certificate in force.
    let trusting = |certified: &rcgen::CertifiedKey<rcgen::KeyPair>| {
        let ca = reqwest::Certificate::from_pem(certified.cert.pem().as_bytes()).unwrap();
        reqwest::Client::builder()
            .tls_certs_only([ca])
            .build()
            .unwrap()
    };
    let url = format!("https://localhost:{port}/v1/streams/sensor_readings/records");
    let send = |client: reqwest::Client, token: &'static str| {
        let url = url.clone();
        async move {
            let body = zstd::encode_all(&ndjson(&[reading(1)])[..], 3).unwrap();
            let answer = client
                .post(url)
                .bearer_auth(token)
                .header("content-type", "application/x-ndjson")
                .header("content-encoding", "zstd")
                .body(body)
                .send()
                .await;
            answer.map(|a| a.status().as_u16())
        }
    };
    let sighup = |child: &Child, logged: &str, times: usize| sighup(child, &log, logged, times);
    const NEW: &str = "a-new-device-token";
    assert_eq!(send(trusting(&first), TOKEN).await.unwrap(), 200);
    assert_eq!(send(trusting(&first), NEW).await.unwrap(), 401);
    assert!(
        send(trusting(&second), TOKEN).await.is_err(),
        "the second certificate is not served yet"
    );

    // The certificate renewed, the old token replaced by a new one.
    write(&second, &hash(NEW));
    tokio::task::block_in_place(|| sighup(&gateway, "SIGHUP: reloaded", 1));
    assert_eq!(send(trusting(&second), NEW).await.unwrap(), 200);
    assert_eq!(send(trusting(&second), TOKEN).await.unwrap(), 401);
    assert!(send(trusting(&first), NEW).await.is_err());

    // A config that does not check: the running tokens and certificate stay.
    write(&first, "not a hash");
    tokio::task::block_in_place(|| sighup(&gateway, "SIGHUP: the config does not load", 1));
    assert_eq!(send(trusting(&second), NEW).await.unwrap(), 200);
    assert!(
        gateway.try_wait().unwrap().is_none(),
        "SIGHUP ended the gateway"
    );
    let status = Command::new("kill")
        .arg(gateway.id().to_string())
        .status()
        .unwrap();
    assert!(status.success());
    assert!(gateway.wait().unwrap().success());
}

/// Sends SIGHUP to `child` and waits until its log (`log`) holds `logged` `times` times.
pub(crate) fn sighup(child: &Child, log: &Path, logged: &str, times: usize) {
    let status = Command::new("kill")
        .args(["-HUP", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_to_string(log)
        .unwrap()
        .matches(logged)
        .count()
        < times
    {
        assert!(Instant::now() < deadline, "no '{logged}' in the log");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Stream definitions changed while the gateway runs, without SIGHUP. A nullable field added
/// to a stream is taken at the first request that sets it: NDJSON records and a Parquet body
/// with the new column (the file is looked at when a request does not fit). A stream defined
/// anew is served at its first request, its topic created. At SIGHUP an incompatible change (a
/// field retyped) is refused whole, the running definitions staying. Before, every definition
/// change took a restart of every gateway, and records, bodies and new streams were refused
/// until then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_definitions_change_without_a_restart() {
    let brokers = env("EDGE_INGEST_KAFKA");
    let port = free_port();
    let id = unique();
    let dir = tempfile::tempdir().unwrap();
    let streams = dir.path().join("streams");
    std::fs::create_dir(&streams).unwrap();
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../streams");
    let sensor = std::fs::read_to_string(shipped.join("sensor_readings.toml")).unwrap();
    std::fs::write(streams.join("sensor_readings.toml"), &sensor).unwrap();
    let config = dir.path().join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:{port}\"\nadmin_listen = \"api\"\nstreams_dir = {streams:?}\n\
             [kafka]\nbrokers = \"{brokers}\"\ntopic_prefix = \"defs{id}.\"\n\
             create_topics = true\ndead_letter_topic = \"defs{id}-dead-letters\"\n\
             [[auth.tokens]]\nname = \"device\"\nblake3 = \"{}\"\nstreams = [\"*\"]\n",
            blake3::hash(TOKEN.as_bytes()).to_hex(),
        ),
    )
    .unwrap();
    let log = dir.path().join("gateway.log");
    let mut gateway = spawn_gateway(&config, port, &log).await;
    let client = reqwest::Client::new();
    // The answer's status and its count of accepted records.
    let post_body = |stream: &str, body: Vec<u8>, content_type: &'static str| {
        let (client, url) = (
            client.clone(),
            format!("http://127.0.0.1:{port}/v1/streams/{stream}/records"),
        );
        async move {
            let answer = client
                .post(url)
                .bearer_auth(TOKEN)
                .header("content-type", content_type)
                .body(body)
                .send()
                .await
                .unwrap();
            let status = answer.status().as_u16();
            let body: Value = answer.json().await.unwrap_or_default();
            (status, body["accepted"].as_u64().unwrap_or(0))
        }
    };
    let post =
        |stream: &str, record: Value| post_body(stream, ndjson(&[record]), "application/x-ndjson");
    let humid = |i: i64| {
        let mut r = reading(i);
        r["humidity"] = json!(41.5);
        r
    };
    let vehicle =
        json!({"vehicle_id": "v1", "recorded_at": 1_767_225_600_000_i64, "lat": 1.0, "lon": 2.0});
    assert_eq!(post("sensor_readings", humid(1)).await, (200, 0));
    assert_eq!(post("vehicle_telemetry", vehicle.clone()).await.0, 404);

    // A nullable field added: taken at the next request that sets it, no SIGHUP; first a
    // Parquet body with the new column, then (another field added) an NDJSON record.
    let extended = format!(
        "{}\n[[fields]]\nname = \"humidity\"\ntype = \"float64\"\n",
        sensor.replace("version = 1", "version = 2")
    );
    std::fs::write(streams.join("sensor_readings.toml"), &extended).unwrap();
    let new_def = schemas::StreamDef::from_toml(&extended).unwrap();
    let mut columns = schemas::columnar::BodyBuilder::new(&new_def, 1);
    columns.push(&schemas::check(&new_def, humid(2)).unwrap().record);
    let parquet = columns.finish(&new_def, 3).unwrap();
    assert_eq!(
        post_body("sensor_readings", parquet, "application/vnd.apache.parquet").await,
        (200, 1)
    );
    let extended = format!(
        "{}\n[[fields]]\nname = \"site\"\ntype = \"string\"\n",
        extended.replace("version = 2", "version = 3")
    );
    std::fs::write(streams.join("sensor_readings.toml"), &extended).unwrap();
    let mut sited = humid(3);
    sited["site"] = json!("plant-7");
    assert_eq!(post("sensor_readings", sited).await, (200, 1));
    let landed = consume(&brokers, &format!("defs{id}.sensor_readings"), 2);
    assert_eq!(landed.len(), 2);
    let mut versions = Vec::new();
    for (payload, headers) in &landed {
        let value: Value = serde_json::from_slice(payload).unwrap();
        assert_eq!(value["humidity"], json!(41.5));
        versions.push(headers["schema-version"].clone());
    }
    versions.sort();
    assert_eq!(versions, ["2", "3"]);
    // A new stream: served at its first request, its topic created, no SIGHUP; a broken file
    // of another stream (being written, say) does not keep it out.
    std::fs::write(streams.join("half_written.toml"), "name = \"half_wr").unwrap();
    std::fs::copy(
        shipped.join("vehicle_telemetry.toml"),
        streams.join("vehicle_telemetry.toml"),
    )
    .unwrap();
    assert_eq!(post("vehicle_telemetry", vehicle.clone()).await, (200, 1));
    assert_eq!(
        consume(&brokers, &format!("defs{id}.vehicle_telemetry"), 1).len(),
        1
    );
    std::fs::remove_file(streams.join("half_written.toml")).unwrap();

    // `quality` retyped: refused, and the definitions with `humidity` stay.
    std::fs::write(
        streams.join("sensor_readings.toml"),
        extended.replace(
            "name = \"quality\"\ntype = \"int64\"",
            "name = \"quality\"\ntype = \"string\"",
        ),
    )
    .unwrap();
    tokio::task::block_in_place(|| sighup(&gateway, &log, "SIGHUP: the config does not load", 1));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("field 'quality' changes type from int64 to string"),
        "{text}"
    );
    assert_eq!(post("sensor_readings", humid(4)).await, (200, 1));
    let mut retyped = reading(5);
    retyped["quality"] = json!("good");
    assert_eq!(post("sensor_readings", retyped).await, (200, 0));
    assert!(
        gateway.try_wait().unwrap().is_none(),
        "SIGHUP ended the gateway"
    );
    gateway.kill().unwrap();
    gateway.wait().unwrap();
}

/// Posts `body` (NDJSON) to the gateway on `port` over a connection of its own, the body
/// trickled at `rate` bytes per second, as a slow uplink carries it; the answer's status.
pub(crate) async fn trickle(port: u16, body: &[u8], rate: u64) -> u16 {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let head = format!(
        "POST /v1/streams/sensor_readings/records HTTP/1.1\r\nhost: localhost\r\n\
         authorization: Bearer {TOKEN}\r\ncontent-type: application/x-ndjson\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    for chunk in body.chunks(500) {
        // An answer before the whole body (408) closes the connection.
        if stream.write_all(chunk).await.is_err() {
            break;
        }
        let pace = chunk.len() as f64 / rate as f64;
        tokio::time::sleep(Duration::from_secs_f64(pace)).await;
    }
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer).await;
    let answer = String::from_utf8_lossy(&answer);
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok());
    status.unwrap_or_else(|| panic!("no answer: {answer:?}"))
}

/// A request's time grows by its `Content-Length` at `limits.min_body_bytes_per_sec`: a body
/// that a slow uplink carries in longer than `request_timeout_ms` is read and produced, and one
/// slower than that rate still gets 408. Before, every attempt of such a body got 408, and the
/// agent behind that link never got its batch in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_uplink_gets_time_for_its_body_by_its_length() {
    let brokers = env("EDGE_INGEST_KAFKA");
    let records: Vec<Value> = (0..150).map(reading).collect();
    let body = ndjson(&records);
    assert!(body.len() > 10_000, "{} bytes", body.len());
    // 1 s, plus the body at 4,000 B/s: 2.5 s more.
    let g = start(&brokers, |c| {
        c.limits.request_timeout_ms = 1_000;
        c.limits.min_body_bytes_per_sec = 4_000;
    })
    .await;
    let port = g.addr.port();
    assert_eq!(trickle(port, &body, 8_000).await, 200, "in 1.3 s");
    assert_eq!(
        trickle(port, &body, 2_000).await,
        408,
        "slower than the floor"
    );
    g.stop().await;
    // The timeout alone, as before.
    let g = start(&brokers, |c| {
        c.limits.request_timeout_ms = 1_000;
        c.limits.min_body_bytes_per_sec = 0;
    })
    .await;
    assert_eq!(trickle(g.addr.port(), &body, 8_000).await, 408);
    g.stop().await;
}
