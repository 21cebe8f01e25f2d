//! The gateway against a real Kafka-protocol broker (tansu, started by scripts/test.sh): acks,
//! topic creation, headers, dead letters, idempotency, bad input next to good input, TLS, and a
//! broker outage with recovery.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ingest_gateway::GatewayConfig;
use ingest_gateway::config::{AuthConfig, TlsConfig, TokenConfig};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, DefaultConsumerContext};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, ClientContext, Offset, Statistics, TopicPartitionList};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

#[path = "../../loadtest/tests/common/mod.rs"]
mod common;

use common::{free_port, proxy};

const TOKEN: &str = "gateway-test-token";

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!(
            "{name} is not set: run the suite with scripts/test.sh, which starts the test services"
        )
    })
}

fn unique() -> String {
    let n = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{}{}", n % 1_000_000_000_000, std::process::id())
}

struct Started {
    addr: SocketAddr,
    prefix: String,
    dlq: String,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Started {
    fn url(&self, stream: &str) -> String {
        format!("http://{}/v1/streams/{stream}/records", self.addr)
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.unwrap().unwrap();
    }
}

fn config(
    brokers: &str,
    tweak: impl FnOnce(&mut GatewayConfig),
) -> (GatewayConfig, String, String) {
    let id = unique();
    let mut c = GatewayConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        auth: AuthConfig {
            allow_anonymous: false,
            tokens: vec![TokenConfig {
                name: "test".into(),
                blake3: blake3::hash(TOKEN.as_bytes()).to_hex().to_string(),
                streams: vec!["*".into()],
                max_bytes_per_sec: None,
            }],
        },
        ..GatewayConfig::default()
    };
    c.kafka.brokers = brokers.to_owned();
    c.kafka.topic_prefix = format!("gw{id}.");
    c.kafka.dead_letter_topic = format!("gw{id}-dead-letters");
    c.kafka.create_topics = true;
    c.kafka.produce_timeout_ms = 10_000;
    tweak(&mut c);
    let (prefix, dlq) = (
        c.kafka.topic_prefix.clone(),
        c.kafka.dead_letter_topic.clone(),
    );
    (c, prefix, dlq)
}

async fn start(brokers: &str, tweak: impl FnOnce(&mut GatewayConfig)) -> Started {
    let (c, prefix, dlq) = config(brokers, tweak);
    let shutdown = CancellationToken::new();
    let g = ingest_gateway::start(c, schemas::example_streams(), shutdown.clone())
        .await
        .unwrap();
    Started {
        addr: g.addr,
        prefix,
        dlq,
        shutdown,
        task: g.task,
    }
}

/// A consumer of every partition of `topic`, from the beginning, with `settings` on top of the
/// usual ones.
fn reader<C: ConsumerContext>(
    brokers: &str,
    topic: &str,
    settings: &[(&str, &str)],
    context: C,
) -> BaseConsumer<C> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("reader-{}", unique()))
        .set("enable.auto.commit", "false");
    for (k, v) in settings {
        config.set(*k, *v);
    }
    let consumer: BaseConsumer<C> = config.create_with_context(context).unwrap();
    let meta = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .unwrap();
    let mut list = TopicPartitionList::new();
    for p in meta.topics()[0].partitions() {
        list.add_partition_offset(topic, p.id(), Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&list).unwrap();
    consumer
}

/// Every message of a topic (all partitions, from the beginning) until `want` arrived.
fn consume(brokers: &str, topic: &str, want: usize) -> Vec<(Vec<u8>, HashMap<String, String>)> {
    let consumer = reader(brokers, topic, &[], DefaultConsumerContext);
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while out.len() < want && Instant::now() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
            let headers = m
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| {
                            (
                                h.key.to_owned(),
                                String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            out.push((m.payload().unwrap_or_default().to_vec(), headers));
        }
    }
    // Anything beyond `want` would be a duplicate: give it a moment to show up.
    let settle = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < settle {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            out.push((m.payload().unwrap_or_default().to_vec(), HashMap::new()));
        }
    }
    out
}

fn reading(i: i64) -> Value {
    json!({"device_id": format!("dev-{}", i % 5), "sensor": "temp", "ts": 1_767_225_600_000_i64 + i, "value": i as f64 / 4.0})
}

fn ndjson(records: &[Value]) -> Vec<u8> {
    records
        .iter()
        .map(|r| format!("{r}\n"))
        .collect::<String>()
        .into_bytes()
}

async fn post(
    client: &reqwest::Client,
    url: &str,
    body: Vec<u8>,
    key: Option<&str>,
) -> reqwest::Response {
    try_post(client, url, body, key).await.unwrap()
}

/// [`post`], returning a failure to connect or to get an answer instead of panicking.
async fn try_post(
    client: &reqwest::Client,
    url: &str,
    body: Vec<u8>,
    key: Option<&str>,
) -> reqwest::Result<reqwest::Response> {
    let mut r = client
        .post(url)
        .bearer_auth(TOKEN)
        .header("content-type", "application/x-ndjson")
        .header("content-encoding", "zstd")
        .body(zstd::encode_all(&body[..], 3).unwrap());
    if let Some(k) = key {
        r = r.header("idempotency-key", k);
    }
    r.send().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_headers_duplicates_and_dead_letters() {
    let brokers = env("EDGE_INGEST_KAFKA");
    let g = start(&brokers, |c| c.limits.max_line_bytes = 200).await;
    let client = reqwest::Client::new();
    let good: Vec<Value> = (0..3).map(reading).collect();
    let mut body = ndjson(&good);
    body.extend_from_slice(format!("{}\n", good[1]).as_bytes()); // 3: duplicate
    body.extend_from_slice(b"{\"device_id\": oops\n"); // 4: malformed
    body.extend_from_slice(b"{\"device_id\":\"d\",\"sensor\":\"s\",\"ts\":1,\"value\":\"hot\"}\n"); // 5: wrong type
    body.extend_from_slice(
        format!(
            "{{\"device_id\":\"{}\",\"sensor\":\"s\",\"ts\":1,\"value\":1}}\n",
            "x".repeat(300)
        )
        .as_bytes(),
    ); // 6: too long
    let res = post(&client, &g.url("sensor_readings"), body, None).await;
    assert_eq!(res.status(), 200);
    let answer: Value = res.json().await.unwrap();
    assert_eq!(answer["accepted"], 3);
    assert_eq!(answer["duplicates"], 1);
    let rejected: Vec<i64> = answer["rejected"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["index"].as_i64().unwrap())
        .collect();
    assert_eq!(rejected, [4, 5, 6], "{answer}");
    assert!(
        answer["rejected"][1]["reason"]
            .as_str()
            .unwrap()
            .contains("field 'value': expected float64")
    );

    let topic = format!("{}sensor_readings", g.prefix);
    let msgs = consume(&brokers, &topic, 3);
    assert_eq!(msgs.len(), 3, "exactly the accepted records, once");
    let def = schemas::example_streams()
        .get("sensor_readings")
        .unwrap()
        .clone();
    let mut got: Vec<String> = msgs
        .iter()
        .map(|(payload, headers)| {
            let record = schemas::wire::decode_value(&def, payload).unwrap();
            let hash = schemas::content_hash(&def, &record);
            assert_eq!(headers["content-hash"], hash.to_hex());
            assert_eq!(headers["schema-version"], "1");
            assert!(headers["ingest-ts"].parse::<i64>().unwrap() > 1_700_000_000_000_000);
            hash.to_hex()
        })
        .collect();
    let mut want: Vec<String> = good
        .iter()
        .map(|r| schemas::check(&def, r.clone()).unwrap().hash.to_hex())
        .collect();
    got.sort();
    want.sort();
    assert_eq!(got, want);

    let dead = consume(&brokers, &g.dlq, 3);
    assert_eq!(dead.len(), 3);
    let codes: Vec<&str> = dead
        .iter()
        .map(|(_, h)| h["reason-code"].as_str())
        .collect();
    assert_eq!(codes, ["malformed", "wrong_type", "malformed"]);
    assert!(dead.iter().all(|(_, h)| h["stream"] == "sensor_readings"));
    // Without an Idempotency-Key, no batch id.
    assert!(dead.iter().all(|(_, h)| !h.contains_key("batch-id")));
    assert_eq!(dead[0].0, b"{\"device_id\": oops");

    let metrics = client
        .get(format!("http://{}/metrics", g.addr))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "gateway_records_total",
        "gateway_rejected_records_total",
        "gateway_http_requests_total",
        "gateway_produced_bytes_total",
        "gateway_produce_duration_seconds",
    ] {
        assert!(metrics.contains(name), "/metrics lacks {name}");
    }
    assert!(metrics.contains(r#"reason="wrong_type""#), "{metrics}");
    g.stop().await;
}

/// librdkafka refuses messages past `queue.buffering.max.messages` (100,000 by default) with
/// QueueFull; the gateway's own limit is its in-flight byte budget, so a burst of small records
/// under that budget must be accepted whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bursts_past_librdkafkas_default_message_count_are_accepted() {
    let brokers = env("EDGE_INGEST_KAFKA");
    let g = start(&brokers, |_| {}).await;
    let client = reqwest::Client::new();
    let (requests, per_request) = (4, 60_000);
    let bodies: Vec<Vec<u8>> = (0..requests)
        .map(|r| {
            ndjson(
                &(r * per_request..(r + 1) * per_request)
                    .map(reading)
                    .collect::<Vec<_>>(),
            )
        })
        .collect();
    let url = g.url("sensor_readings");
    let answers = futures::future::join_all(
        bodies
            .into_iter()
            .map(|body| post(&client, &url, body, None)),
    )
    .await;
    for res in answers {
        assert_eq!(res.status(), 200, "{}", res.text().await.unwrap());
    }
    g.stop().await;
}

/// What librdkafka's statistics say about a consumer's fetches, summed over its brokers.
#[derive(Default)]
struct FetchStats {
    reports: AtomicU64,
    /// Bytes received from the brokers.
    rx_bytes: AtomicU64,
    /// Message sets decompressed again into a bigger buffer: a zstd frame that does not carry
    /// its uncompressed size is decompressed into a guessed buffer, and again on each miss.
    zbuf_grow: AtomicU64,
}

impl ClientContext for FetchStats {
    fn stats(&self, stats: Statistics) {
        let sum = |f: fn(&rdkafka::statistics::Broker) -> u64| stats.brokers.values().map(f).sum();
        self.rx_bytes.store(sum(|b| b.rxbytes), Ordering::Relaxed);
        self.zbuf_grow
            .store(sum(|b| b.zbuf_grow), Ordering::Relaxed);
        self.reports.fetch_add(1, Ordering::Relaxed);
    }
}

impl ConsumerContext for FetchStats {}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_decompress_the_gateways_message_sets_once() {
    let brokers = env("EDGE_INGEST_KAFKA");
    let g = start(&brokers, |_| {}).await;
    let n = 5_000;
    let body = ndjson(&(0..n).map(reading).collect::<Vec<_>>());
    let res = post(
        &reqwest::Client::new(),
        &g.url("sensor_readings"),
        body,
        None,
    )
    .await;
    assert_eq!(res.status(), 200, "{}", res.text().await.unwrap());
    let topic = format!("{}sensor_readings", g.prefix);
    g.stop().await;

    let stats_every = [("statistics.interval.ms", "100")];
    let consumer = reader(&brokers, &topic, &stats_every, FetchStats::default());
    let (mut got, mut message_bytes) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    while got < n && Instant::now() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            got += 1;
            let headers = m.headers().map_or(0, |h| {
                h.iter()
                    .map(|h| h.key.len() + h.value.map_or(0, <[u8]>::len))
                    .sum()
            });
            message_bytes += m.payload_len() + m.key().map_or(0, <[u8]>::len) + headers;
        }
    }
    assert_eq!(got, n);
    // Statistics after the last fetch.
    let stats = consumer.context();
    let seen = stats.reports.load(Ordering::Relaxed);
    while stats.reports.load(Ordering::Relaxed) < seen + 2 && Instant::now() < deadline {
        let _ = consumer.poll(Duration::from_millis(50));
    }
    let rx = stats.rx_bytes.load(Ordering::Relaxed) as usize;
    // Under half: a consumer that guessed twice the compressed size would have to grow.
    assert!(
        rx * 2 < message_bytes,
        "the records travel zstd-compressed: {rx} bytes received for {message_bytes}"
    );
    assert_eq!(
        stats.zbuf_grow.load(Ordering::Relaxed),
        0,
        "every message set carries its uncompressed size (librdkafka built with WITH_ZSTD_STATIC, \
         see .cargo/config.toml), so consumers decompress it once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_key_replays_the_first_answer_without_producing() {
    let brokers = env("EDGE_INGEST_KAFKA");
    let g = start(&brokers, |_| {}).await;
    let client = reqwest::Client::new();
    let body = ndjson(&(10..20).map(reading).collect::<Vec<_>>());
    let key = blake3::hash(&body).to_hex().to_string();
    let first = post(&client, &g.url("sensor_readings"), body.clone(), Some(&key)).await;
    assert_eq!(first.status(), 200);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first: Value = first.json().await.unwrap();
    let second = post(&client, &g.url("sensor_readings"), body.clone(), Some(&key)).await;
    assert_eq!(second.status(), 200);
    assert_eq!(second.headers()["idempotent-replayed"], "true");
    assert_eq!(second.json::<Value>().await.unwrap(), first);
    // The same records compressed otherwise (here: not at all) are the same request.
    let plain = client
        .post(g.url("sensor_readings"))
        .bearer_auth(TOKEN)
        .header("content-type", "application/x-ndjson")
        .header("idempotency-key", &key)
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(plain.status(), 200);
    assert_eq!(plain.headers()["idempotent-replayed"], "true");
    // The key again with other records: refused, not answered as if they were accepted.
    let other = ndjson(&(20..30).map(reading).collect::<Vec<_>>());
    let reused = post(
        &client,
        &g.url("sensor_readings"),
        other.clone(),
        Some(&key),
    )
    .await;
    assert_eq!(reused.status(), 422);
    let error: Value = reused.json().await.unwrap();
    assert_eq!(error["error"], "idempotency_key_reused", "{error}");
    let fresh = post(
        &client,
        &g.url("sensor_readings"),
        other,
        Some("another-key"),
    )
    .await;
    assert_eq!(fresh.status(), 200);
    let topic = format!("{}sensor_readings", g.prefix);
    let msgs = consume(&brokers, &topic, 20);
    assert_eq!(
        msgs.len(),
        20,
        "the replays and the refused request produced nothing"
    );
    g.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_exact_statuses_and_lose_nothing_else() {
    let brokers = env("EDGE_INGEST_KAFKA");
    let g = start(&brokers, |c| {
        c.limits.max_body_bytes = 256 << 10;
        c.limits.max_decompressed_bytes = 4 << 20;
    })
    .await;
    let client = reqwest::Client::new();
    let url = g.url("sensor_readings");
    let bomb = zstd::encode_all(&vec![b'\n'; 64 << 20][..], 19).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    std::io::Write::write_all(&mut gz, &vec![b' '; 32 << 20]).unwrap();
    let gzip_bomb = gz.finish().unwrap();
    let raw = |ct: &str, enc: &str, body: Vec<u8>, token: &str| {
        client
            .post(&url)
            .bearer_auth(token)
            .header("content-type", ct)
            .header("content-encoding", enc)
            .body(body)
    };
    let cases: Vec<(&str, reqwest::RequestBuilder, u16)> = vec![
        (
            "malformed JSON array",
            raw("application/json", "identity", b"[{\"a\":1".to_vec(), TOKEN),
            400,
        ),
        (
            "zstd bomb",
            raw("application/x-ndjson", "zstd", bomb, TOKEN),
            413,
        ),
        (
            "gzip bomb",
            raw("application/x-ndjson", "gzip", gzip_bomb, TOKEN),
            413,
        ),
        (
            "oversized",
            raw(
                "application/x-ndjson",
                "identity",
                vec![b' '; 300 << 10],
                TOKEN,
            ),
            413,
        ),
        (
            "bad encoding",
            raw("application/x-ndjson", "deflate", b"{}".to_vec(), TOKEN),
            415,
        ),
        (
            "corrupt gzip",
            raw(
                "application/x-ndjson",
                "gzip",
                b"\x1f\x8b\x08junk".to_vec(),
                TOKEN,
            ),
            400,
        ),
        (
            "bad token",
            raw("application/x-ndjson", "identity", b"{}".to_vec(), "wrong"),
            401,
        ),
        (
            "hostile stream",
            client
                .post(format!("http://{}/v1/streams/a%00b/records", g.addr))
                .bearer_auth(TOKEN)
                .header("content-type", "application/x-ndjson")
                .body("{}"),
            400,
        ),
        (
            "unknown stream",
            client
                .post(format!("http://{}/v1/streams/nope/records", g.addr))
                .bearer_auth(TOKEN)
                .header("content-type", "application/x-ndjson")
                .body("{}"),
            404,
        ),
        (
            "not an object",
            raw("application/json", "identity", b"{\"a\":1}".to_vec(), TOKEN),
            400,
        ),
    ];
    let good = (100..160).map(reading).collect::<Vec<_>>();
    let mut handles = Vec::new();
    for chunk in good.chunks(20) {
        let body = ndjson(chunk);
        let client = client.clone();
        let url = url.clone();
        handles.push(tokio::spawn(async move {
            post(&client, &url, body, None).await.status().as_u16()
        }));
    }
    for (name, request, status) in cases {
        let res = request.send().await.unwrap();
        assert_eq!(res.status().as_u16(), status, "{name}");
        let body: Value = res
            .json()
            .await
            .unwrap_or_else(|e| panic!("{name}: error body is not JSON: {e}"));
        assert!(
            body["error"].is_string() && body["message"].is_string(),
            "{name}: {body}"
        );
    }
    for h in handles {
        assert_eq!(h.await.unwrap(), 200);
    }
    let msgs = consume(&brokers, &format!("{}sensor_readings", g.prefix), 60);
    assert_eq!(
        msgs.len(),
        60,
        "every good record once, nothing from the bad requests"
    );
    g.stop().await;
}

/// A record under the line limit (1 MiB) whose Kafka message is over the producer's
/// `message.max.bytes` (librdkafka's 1,000,000): librdkafka refuses it at once, and the whole
/// request was answered 503, so a client (the agent) retried it for ever and its stream stood
/// still. It is now rejected alone, into the dead-letter topic, and the rest is produced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_too_large_for_a_kafka_message_is_rejected_alone() {
    let brokers = env("EDGE_INGEST_KAFKA");
    let g = start(&brokers, |_| {}).await;
    let client = reqwest::Client::new();
    let mut big = reading(7);
    big["unit"] = Value::String("x".repeat(1_010_000));
    let body = ndjson(&[reading(0), big, reading(1)]);
    assert!(body.len() < 1 << 20);
    let res = post(&client, &g.url("sensor_readings"), body, Some("batch-7")).await;
    assert_eq!(res.status(), 200);
    let answer: Value = res.json().await.unwrap();
    assert_eq!(answer["accepted"], 2, "{answer}");
    assert_eq!(answer["rejected"][0]["index"], 1, "{answer}");
    let reason = answer["rejected"][0]["reason"].as_str().unwrap();
    assert!(reason.contains("message.max.bytes is 1000000"), "{reason}");
    let msgs = consume(&brokers, &format!("{}sensor_readings", g.prefix), 2);
    assert_eq!(msgs.len(), 2);
    let dead = consume(&brokers, &g.dlq, 1);
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1["reason-code"], "too_large");
    assert_eq!(dead[0].1["truncated"], "true");
    // The request's Idempotency-Key, by which `redrive` tells a repeat (the request produced
    // again after a crash) from another record.
    assert_eq!(dead[0].1["batch-id"], "batch-7");
    assert_eq!(dead[0].1["record-index"], "1");
    g.stop().await;
}

/// A broker whose limit is below the producer's `message.max.bytes` refuses a record batch as
/// too large: no retry gets past that, and the 503 it was answered with made a client retry for
/// ever. It is answered 413 (the agent keeps the batch aside); the producer goes on with the
/// next request. librdkafka's mock cluster stands in for the broker (tansu cannot be given a
/// smaller limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_the_broker_refuses_as_too_large_is_answered_413() {
    let cluster = rdkafka::mocking::MockCluster::new(1).unwrap();
    // The mock cluster takes no admin requests: its topics are made here.
    let g = start(&cluster.bootstrap_servers(), |c| {
        c.kafka.create_topics = false;
        let topic = format!("{}sensor_readings", c.kafka.topic_prefix);
        for t in [topic.as_str(), &c.kafka.dead_letter_topic] {
            cluster.create_topic(t, 1, 1).unwrap();
        }
    })
    .await;
    let client = reqwest::Client::new();
    let url = g.url("sensor_readings");
    let first = post(&client, &url, ndjson(&[reading(1)]), None).await;
    assert_eq!(first.status(), 200);
    cluster.request_errors(
        rdkafka::types::RDKafkaApiKey::Produce,
        &[rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE],
    );
    let refused = post(&client, &url, ndjson(&[reading(2)]), None).await;
    assert_eq!(refused.status(), 413);
    assert!(refused.headers().get("retry-after").is_none());
    let error: Value = refused.json().await.unwrap();
    assert_eq!(error["error"], "payload_too_large");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("message.max.bytes"),
        "{error}"
    );
    let next = post(&client, &url, ndjson(&[reading(3)]), None).await;
    assert_eq!(next.status(), 200);
    g.stop().await;
}

/// A tansu of this test's own that advertises `advertised` (the proxy) instead of its own port.
fn spawn_tansu(port: u16, advertised: u16) -> Child {
    let child = Command::new(env("EDGE_INGEST_TANSU"))
        .args([
            "broker",
            "--listener-url",
            &format!("tcp://127.0.0.1:{port}"),
        ])
        .args([
            "--advertised-listener-url",
            &format!("tcp://127.0.0.1:{advertised}"),
        ])
        .args(["--storage-engine", "memory://tansu/"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "tansu did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_outage_answers_503_with_retry_after_then_recovers() {
    plumbing::init_tracing();
    let (port, front) = (free_port(), free_port());
    let mut broker = spawn_tansu(port, front);
    let outage = proxy(front, port).await;
    let brokers = format!("127.0.0.1:{front}");
    let g = start(&brokers, |c| {
        c.kafka.produce_timeout_ms = 2_000;
        c.limits.request_timeout_ms = 5_000;
    })
    .await;
    let client = reqwest::Client::new();
    let url = g.url("sensor_readings");
    assert_eq!(
        post(&client, &url, ndjson(&[reading(1)]), None)
            .await
            .status(),
        200
    );

    outage.cancel();
    let res = post(&client, &url, ndjson(&[reading(2)]), None).await;
    assert_eq!(res.status(), 503);
    let retry: u64 = res.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["error"], "unavailable");

    let _back = proxy(front, port).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = post(&client, &url, ndjson(&[reading(2)]), None)
            .await
            .status();
        if status == 200 {
            break;
        }
        assert_eq!(status, 503);
        assert!(Instant::now() < deadline, "the gateway did not recover");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let msgs = consume(&brokers, &format!("{}sensor_readings", g.prefix), 2);
    let def = schemas::example_streams()
        .get("sensor_readings")
        .unwrap()
        .clone();
    let hashes: std::collections::HashSet<String> = msgs
        .iter()
        .map(|(p, _)| {
            schemas::content_hash(&def, &schemas::wire::decode_value(&def, p).unwrap()).to_hex()
        })
        .collect();
    assert_eq!(
        hashes.len(),
        2,
        "both records are in Kafka (a retried one may be there twice; the sink drops it)"
    );
    g.stop().await;
    broker.kill().unwrap();
    broker.wait().unwrap();
}

/// Stopped while the broker is down and a request waits for its acknowledgement: the request
/// still gets its answer (503 with Retry-After, never 200 and never a dropped connection) once
/// `produce_timeout_ms` has passed, and the gateway stops once it is answered. Before, the
/// answer came up to librdkafka's reconnect backoff (10 s) late: a broker thread that waits to
/// reconnect does not time out its messages meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_a_broker_outage_answers_the_waiting_request_503() {
    let (port, front) = (free_port(), free_port());
    let mut broker = spawn_tansu(port, front);
    let outage = proxy(front, port).await;
    let brokers = format!("127.0.0.1:{front}");
    let g = start(&brokers, |c| {
        c.kafka.produce_timeout_ms = 3_000;
        c.limits.request_timeout_ms = 10_000;
    })
    .await;
    let client = reqwest::Client::new();
    let url = g.url("sensor_readings");
    let first = post(&client, &url, ndjson(&[reading(1)]), None).await;
    assert_eq!(first.status(), 200);

    outage.cancel();
    let posted = Instant::now();
    let waiting = {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move { try_post(&client, &url, ndjson(&[reading(2)]), None).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiting.is_finished(),
        "answered before the produce timed out"
    );
    g.shutdown.cancel();
    let res = waiting
        .await
        .unwrap()
        .expect("the waiting request lost its connection");
    let answered = posted.elapsed();
    assert_eq!(res.status(), 503);
    assert!(res.headers().contains_key("retry-after"));
    // 3 s, and librdkafka looks for timed-out messages once a second; not the 10 s backoff.
    assert!(
        answered < Duration::from_millis(3_000 + 3_000),
        "answered {answered:?} after the post, against a produce timeout of 3 s"
    );
    tokio::time::timeout(Duration::from_secs(20), g.task)
        .await
        .expect("the gateway did not stop")
        .unwrap()
        .unwrap();
    broker.kill().unwrap();
    broker.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_listen_moves_metrics_and_health_off_the_api_port() {
    let brokers = env("EDGE_INGEST_KAFKA");
    let (c, ..) = config(&brokers, |c| {
        c.admin_listen = Some(([127, 0, 0, 1], 0).into());
    });
    let shutdown = CancellationToken::new();
    let g = ingest_gateway::start(c, schemas::example_streams(), shutdown.clone())
        .await
        .unwrap();
    let admin = g.admin_addr.expect("an admin listener");
    let client = reqwest::Client::new();
    for path in ["/metrics", "/healthz", "/readyz"] {
        let api = client
            .get(format!("http://{}{path}", g.addr))
            .send()
            .await
            .unwrap();
        assert_eq!(api.status(), 404, "{path} on the API port");
    }
    let url = format!("http://{}/v1/streams/sensor_readings/records", g.addr);
    assert_eq!(
        post(&client, &url, ndjson(&[reading(1)]), None)
            .await
            .status(),
        200
    );
    let health = client
        .get(format!("http://{admin}/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let metrics = client
        .get(format!("http://{admin}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("gateway_records_total{stream=\"sensor_readings\",outcome=\"accepted\"}"),
        "{metrics}"
    );
    shutdown.cancel();
    g.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_tls_when_given_a_certificate() {
    let brokers = env("EDGE_INGEST_KAFKA");
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
    let g = start(&brokers, |c| {
        c.tls = Some(TlsConfig {
            cert: cert_path,
            key: key_path,
            client_ca_file: None,
        })
    })
    .await;
    let client = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(cert.cert.pem().as_bytes()).unwrap())
        .build()
        .unwrap();
    let port = g.addr.port();
    let url = format!("https://localhost:{port}/v1/streams/sensor_readings/records");
    let res = post(&client, &url, ndjson(&[reading(7)]), None).await;
    assert_eq!(res.status(), 200);
    assert_eq!(res.json::<Value>().await.unwrap()["accepted"], 1);
    let plain = reqwest::get(format!("http://127.0.0.1:{port}/healthz")).await;
    assert!(
        plain.is_err() || !plain.unwrap().status().is_success(),
        "plain HTTP must not be served"
    );
    g.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_violations_of_the_openapi_document() {
    let brokers = env("EDGE_INGEST_KAFKA");
    let python = env("EDGE_INGEST_PYTHON");
    let g = start(&brokers, |_| {}).await;
    let st = Path::new(&python).with_file_name("schemathesis");
    let addr = g.addr;
    // schemathesis keeps a cache in its working directory: give it a scratch one.
    let scratch = tempfile::tempdir().unwrap();
    let cwd = scratch.path().to_path_buf();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(st)
            .current_dir(cwd)
            .args(["run", &format!("http://{addr}/openapi.json")])
            .args(["--header", &format!("Authorization: Bearer {TOKEN}")])
            .args(["--checks", "all", "--max-examples", "30", "--seed", "1"])
            .env("SCHEMATHESIS_HOOKS", "")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "schemathesis failed:\n{text}");
    g.stop().await;
}

/// A gateway config on `port` for tansu at `brokers` (topics `prefix`<stream>, dead letters to
/// `dead_letters`), taking [`TOKEN`], with the TOML of `more` after it.
fn gateway_toml(port: u16, brokers: &str, prefix: &str, dead_letters: &str, more: &str) -> String {
    format!(
        "listen = \"127.0.0.1:{port}\"\nstreams_dir = {streams:?}\n\
         [kafka]\nbrokers = \"{brokers}\"\ntopic_prefix = \"{prefix}\"\n\
         create_topics = true\nproduce_timeout_ms = 10000\n\
         dead_letter_topic = \"{dead_letters}\"\n\
         [auth]\nallow_anonymous = false\n[[auth.tokens]]\nname = \"test\"\n\
         blake3 = \"{hash}\"\nstreams = [\"*\"]\n{more}",
        streams = Path::new(env!("CARGO_MANIFEST_DIR")).join("../streams"),
        hash = blake3::hash(TOKEN.as_bytes()).to_hex(),
    )
}

/// Returns once something accepts connections on `port` (waiting on the runtime's timer, not
/// blocking one of its threads); 30 s at most.
async fn listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "the gateway did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The gateway binary on `config` (a TOML file), listening on `port`; returns once it accepts
/// connections.
async fn spawn_gateway(config: &Path, port: u16, log: &Path) -> Child {
    let child = Command::new(env!("CARGO_BIN_EXE_ingest-gateway"))
        .arg("--config")
        .arg(config)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    listening(port).await;
    child
}

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
                "listen = \"127.0.0.1:{port}\"\nstreams_dir = {streams:?}\n\
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
fn sighup(child: &Child, log: &Path, logged: &str, times: usize) {
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
            "listen = \"127.0.0.1:{port}\"\nstreams_dir = {streams:?}\n\
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
async fn trickle(port: u16, body: &[u8], rate: u64) -> u16 {
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

/// Records the gateway rejected because its definition lagged (a field its producers already
/// set) are in the dead-letter topic. Once the definition has the field, `redrive` produces them
/// to the stream's topic in the wire format: a dry run counts and produces nothing, and the run
/// produces exactly the 20 with the new schema version.
/// Garbage stays (counted by reason), a record cut at 64 KiB in the dead-letter topic is counted
/// and left, and another stream's dead letters are not touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_records_are_redriven_once_a_definition_takes_them() {
    use ingest_gateway::redrive::{RedriveOptions, redrive};
    let brokers = env("EDGE_INGEST_KAFKA");
    let (c, prefix, dlq) = config(&brokers, |_| {});
    let shutdown = CancellationToken::new();
    let g = ingest_gateway::start(c.clone(), schemas::example_streams(), shutdown.clone())
        .await
        .unwrap();
    let client = reqwest::Client::new();
    let url = |stream: &str| format!("http://{}/v1/streams/{stream}/records", g.addr);
    let humid: Vec<Value> = (0..20)
        .map(|i| {
            let mut r = reading(i);
            r["humidity"] = json!(40.0 + i as f64);
            r
        })
        .collect();
    let plain: Vec<Value> = (100..110).map(reading).collect();
    let mut big = reading(200);
    big["humidity"] = json!(1.0);
    big["unit"] = json!("x".repeat(70_000));
    let mut body = ndjson(&plain);
    body.extend(ndjson(&humid));
    body.extend_from_slice(b"{\"device_id\": oops\n[]\n");
    body.extend(ndjson(&[big]));
    let res = post(&client, &url("sensor_readings"), body, None).await;
    let answer: Value = res.json().await.unwrap();
    assert_eq!(answer["accepted"], 10, "{answer}");
    assert_eq!(answer["rejected"].as_array().unwrap().len(), 23);
    let res = post(
        &client,
        &url("vehicle_telemetry"),
        b"{oops\n".to_vec(),
        None,
    )
    .await;
    assert_eq!(
        res.json::<Value>().await.unwrap()["rejected"][0]["index"],
        0
    );
    shutdown.cancel();
    g.task.await.unwrap().unwrap();

    let shipped = include_str!("../../streams/sensor_readings.toml");
    let extended = format!(
        "{}\n[[fields]]\nname = \"humidity\"\ntype = \"float64\"\n",
        shipped.replace("version = 1", "version = 2")
    );
    let streams = schemas::Streams::from_sources([("sensor_readings", extended.as_str())]).unwrap();
    let def = streams.get("sensor_readings").unwrap().clone();
    let options = |since_ms: Option<i64>, dry_run: bool| RedriveOptions {
        stream: "sensor_readings".into(),
        since_ms,
        dry_run,
    };
    let dry = redrive(&c, &streams, &options(None, true)).await.unwrap();
    let t = &dry.tally;
    assert_eq!(
        (
            dry.read,
            dry.truncated,
            t.records,
            t.redriven,
            t.still_invalid
        ),
        (24, 1, 22, 20, 2),
        "{dry:?}"
    );
    assert_eq!(t.reasons.values().sum::<u64>(), 2);
    let report = redrive(&c, &streams, &options(None, false)).await.unwrap();
    assert_eq!(report.tally.redriven, 20, "{report:?}");
    assert!(report.read_through_ms.is_some());
    // A second run, over the same window: the redrive notes of the first leave its 20 out.
    let again = redrive(&c, &streams, &options(None, false)).await.unwrap();
    assert_eq!(
        (
            again.read,
            again.redriven_before,
            again.tally.redriven,
            again.tally.still_invalid,
            again.truncated
        ),
        (24, 20, 0, 2, 1),
        "{again:?}"
    );

    let topic = format!("{prefix}sensor_readings");
    let msgs = consume(&brokers, &topic, 30);
    assert_eq!(
        msgs.len(),
        30,
        "the 10 accepted and the 20 redriven, once each"
    );
    let mut versions: Vec<&str> = msgs
        .iter()
        .map(|(_, h)| h["schema-version"].as_str())
        .collect();
    versions.sort_unstable();
    assert_eq!(versions.iter().filter(|v| **v == "2").count(), 20);
    let mut got: Vec<String> = msgs
        .iter()
        .map(|(_, h)| h["content-hash"].clone())
        .collect();
    let mut want: Vec<String> = plain
        .iter()
        .chain(&humid)
        .map(|r| schemas::check(&def, r.clone()).unwrap().hash.to_hex())
        .collect();
    got.sort();
    want.sort();
    assert_eq!(got, want);
    let dead = consume(&brokers, &dlq, 25);
    let notes = dead
        .iter()
        .filter(|(_, h)| h.contains_key("redriven"))
        .count();
    assert_eq!(
        (dead.len() - notes, notes),
        (24, 1),
        "the dead letters stay, and the first run added one note"
    );

    // The command as an operator runs it: a dry run's JSON report, `--since` as RFC 3339 or
    // epoch milliseconds (after the dead letters: none redriven), and a time it cannot read.
    let dir = tempfile::tempdir().unwrap();
    let streams_dir = dir.path().join("streams");
    std::fs::create_dir(&streams_dir).unwrap();
    std::fs::write(streams_dir.join("sensor_readings.toml"), &extended).unwrap();
    let config = dir.path().join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "streams_dir = {streams_dir:?}\n[kafka]\nbrokers = \"{brokers}\"\n\
             topic_prefix = \"{prefix}\"\ndead_letter_topic = \"{dlq}\"\n"
        ),
    )
    .unwrap();
    let run = |since: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_ingest-gateway"))
            .args([
                "redrive",
                "--stream",
                "sensor_readings",
                "--dry-run",
                "--since",
                since,
            ])
            .arg("--config")
            .arg(&config)
            .output()
            .unwrap();
        let report = serde_json::from_slice::<Value>(&out.stdout).unwrap_or_default();
        (
            out.status.success(),
            report,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, report, stderr) = run("1970-01-01T00:00:00Z");
    assert!(ok, "{stderr}");
    assert_eq!(
        (
            &report["redriven"],
            &report["redriven_before"],
            &report["dry_run"]
        ),
        (&json!(0), &json!(20), &json!(true)),
        "{report}"
    );
    let later = (report["read_through_ms"].as_i64().unwrap() + 1).to_string();
    let (ok, report, stderr) = run(&later);
    assert!(ok, "{stderr}");
    assert_eq!(
        (&report["redriven"], &report["before_since"]),
        (&json!(0), &json!(24)),
        "{report}"
    );
    let (ok, _, stderr) = run("yesterday");
    assert!(!ok);
    assert!(
        stderr.contains("neither RFC 3339 nor epoch milliseconds"),
        "{stderr}"
    );
}

/// `redrive --since` leaves out the dead letters older than that time (their Kafka timestamps),
/// and a time after the last one redrives nothing. On librdkafka's mock cluster, where messages
/// can be produced with any time. (The topic is read from its start: neither tansu 0.6 nor the
/// mock cluster finds offsets by time.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redrive_since_leaves_out_older_dead_letters() {
    use ingest_gateway::redrive::{RedriveOptions, redrive};
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let cluster = rdkafka::mocking::MockCluster::new(1).unwrap();
    let (mut c, prefix, dlq) = config(&cluster.bootstrap_servers(), |_| {});
    c.kafka.create_topics = false;
    cluster.create_topic(&dlq, 1, 1).unwrap();
    cluster
        .create_topic(&format!("{prefix}sensor_readings"), 1, 1)
        .unwrap();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", cluster.bootstrap_servers())
        .create()
        .unwrap();
    let hour = 3_600_000;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    for (i, at) in [now - 3 * hour, now - 2 * hour, now - hour]
        .into_iter()
        .enumerate()
    {
        let value = reading(i as i64).to_string();
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "stream",
                value: Some("sensor_readings"),
            })
            .insert(Header {
                key: "truncated",
                value: Some("false"),
            });
        producer
            .send(
                FutureRecord::to(&dlq)
                    .key("sensor_readings")
                    .payload(&value)
                    .timestamp(at)
                    .headers(headers),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
    }
    let streams = schemas::example_streams();
    let options = |since_ms| RedriveOptions {
        stream: "sensor_readings".into(),
        since_ms: Some(since_ms),
        dry_run: true,
    };
    for (since, read) in [
        (now - 4 * hour, 3),
        (now - 2 * hour - 1, 2),
        (now - hour, 1),
        (now, 0),
    ] {
        let report = redrive(&c, &streams, &options(since)).await.unwrap();
        assert_eq!(
            (report.read, report.before_since, report.tally.redriven),
            (3, 3 - read, read),
            "since {} h ago: {report:?}",
            (now - since) as f64 / hour as f64
        );
    }
}

/// A producer that crashed after producing a batch's dead letters, and then produced the batch
/// again, left two copies of each: the same `batch-id` (the request's Idempotency-Key, the
/// agent's batch id) and `record-index`. `redrive` produces one of them and counts the other as
/// `repeated`; dead letters without a batch id cannot be told apart and go as they are; the same
/// index in another batch is another record. A second run finds the first copies noted and the
/// repeats repeated. On librdkafka's mock cluster, where the dead letters are produced as a
/// test wants them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_dead_letters_are_redriven_once() {
    use ingest_gateway::redrive::{RedriveOptions, redrive};
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let cluster = rdkafka::mocking::MockCluster::new(1).unwrap();
    let (mut c, prefix, dlq) = config(&cluster.bootstrap_servers(), |_| {});
    c.kafka.create_topics = false;
    cluster.create_topic(&dlq, 1, 1).unwrap();
    let topic = format!("{prefix}sensor_readings");
    cluster.create_topic(&topic, 1, 1).unwrap();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", cluster.bootstrap_servers())
        .create()
        .unwrap();
    // (reading, batch id, index): b1's two dead letters twice, one without a batch id twice,
    // and b2's first.
    let dead = [
        (0, Some("b1"), "0"),
        (1, Some("b1"), "1"),
        (2, None, "0"),
        (0, Some("b1"), "0"),
        (1, Some("b1"), "1"),
        (2, None, "0"),
        (3, Some("b2"), "0"),
    ];
    for (reading_no, batch, index) in dead {
        let value = reading(reading_no).to_string();
        let mut headers = OwnedHeaders::new()
            .insert(Header {
                key: "stream",
                value: Some("sensor_readings"),
            })
            .insert(Header {
                key: "record-index",
                value: Some(index),
            })
            .insert(Header {
                key: "truncated",
                value: Some("false"),
            });
        if let Some(batch) = batch {
            headers = headers.insert(Header {
                key: "batch-id",
                value: Some(batch),
            });
        }
        producer
            .send(
                FutureRecord::to(&dlq)
                    .key("sensor_readings")
                    .payload(&value)
                    .headers(headers),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
    }
    let streams = schemas::example_streams();
    let options = RedriveOptions {
        stream: "sensor_readings".into(),
        since_ms: None,
        dry_run: false,
    };
    let first = redrive(&c, &streams, &options).await.unwrap();
    assert_eq!(
        (first.read, first.repeated, first.tally.redriven),
        (7, 2, 5),
        "{first:?}"
    );
    let second = redrive(&c, &streams, &options).await.unwrap();
    assert_eq!(
        (
            second.read,
            second.repeated,
            second.redriven_before,
            second.tally.redriven
        ),
        (7, 2, 5, 0),
        "{second:?}"
    );
    use rdkafka::producer::Producer as _;
    let (low, high) = producer
        .client()
        .fetch_watermarks(&topic, 0, Duration::from_secs(5))
        .unwrap();
    assert_eq!(high - low, 5, "readings 0, 1 and 3 once, 2 twice");
}

/// A line of /proc/<pid>/status in KiB (`VmRSS`, `VmHWM`).
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// A gateway binary on tansu with the `[limits]` given, listening on a port of its own.
async fn spawn_limited(brokers: &str, dir: &Path, limits: &str) -> (Child, u16, String) {
    let port = free_port();
    let prefix = format!("gwmem{}.", unique());
    let config = dir.join("gateway.toml");
    std::fs::write(
        &config,
        gateway_toml(
            port,
            brokers,
            &prefix,
            &format!("{prefix}dead-letters"),
            &format!("[limits]\n{limits}\n"),
        ),
    )
    .unwrap();
    let child = spawn_gateway(&config, port, &dir.join("gateway.log")).await;
    (child, port, prefix)
}

/// Many requests at once whose zstd bodies each decompress to the limit (16 MiB of one reading
/// repeated, a few KiB as sent; half with their size in the frame, half without): the gateway
/// takes no more memory than `max_inflight_bytes` (128 MiB) and a fixed overhead, answers the
/// excess 429 with `Retry-After`, produces the reading of every request it accepted once, and
/// serves normally afterwards. Before, every request held its decompressed body whatever the
/// budget said. A request that needs more than the whole budget is answered 413: no retry
/// would do better.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_bodies_stay_within_the_inflight_budget() {
    const REQUESTS: i64 = 48;
    const LIMIT: usize = 16 << 20;
    const BUDGET: u64 = 128 << 20;
    // The gateway's own memory besides the budget under this load: its allocator's pages kept
    // for reuse, the blocking threads' stacks and zstd contexts, librdkafka's buffers.
    const OVERHEAD: u64 = 48 << 20;
    let brokers = env("EDGE_INGEST_KAFKA");
    let dir = tempfile::tempdir().unwrap();
    let (mut gateway, port, prefix) = spawn_limited(
        &brokers,
        dir.path(),
        &format!(
            "max_body_bytes = 1048576\nmax_decompressed_bytes = {LIMIT}\n\
             max_inflight_bytes = {BUDGET}\nmax_concurrent_requests = 256\n\
             request_timeout_ms = 60000"
        ),
    )
    .await;
    let url = format!("http://127.0.0.1:{port}/v1/streams/sensor_readings/records");
    let client = reqwest::Client::new();
    // Warmed up: the producer connected and the topic made.
    let warm = post(&client, &url, ndjson(&[reading(-1)]), None).await;
    assert_eq!(warm.status(), 200);
    let baseline = status_kib(gateway.id(), "VmRSS") << 10;

    let bodies: Vec<(i64, Vec<u8>)> = (0..REQUESTS)
        .map(|i| {
            let mut record = reading(i);
            record["tags"] = json!({"pad": "x".repeat(400)});
            let line = format!("{record}\n");
            let plain = line.repeat((LIMIT - 1024) / line.len());
            let body = if i % 2 == 0 {
                zstd::bulk::compress(plain.as_bytes(), 3).unwrap()
            } else {
                zstd::encode_all(plain.as_bytes(), 3).unwrap()
            };
            (i, body)
        })
        .collect();
    let answers = futures::future::join_all(bodies.into_iter().map(|(i, body)| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let answer = client
                .post(&url)
                .bearer_auth(TOKEN)
                .header("content-type", "application/x-ndjson")
                .header("content-encoding", "zstd")
                .body(body)
                .send()
                .await
                .unwrap();
            let retry_after = answer.headers().get("retry-after").cloned();
            let status = answer.status().as_u16();
            let text = answer.text().await.unwrap();
            (i, status, retry_after, text)
        }
    }))
    .await;
    let peak = status_kib(gateway.id(), "VmHWM") << 10;
    let mut accepted = Vec::new();
    for (i, status, retry_after, text) in &answers {
        match status {
            200 => {
                let answer: Value = serde_json::from_str(text).unwrap();
                assert_eq!(answer["accepted"], 1, "{text}");
                accepted.push(*i);
            }
            429 => {
                assert!(retry_after.is_some(), "429 without Retry-After: {text}");
                assert!(text.contains("in-flight bytes"), "{text}");
            }
            other => panic!("request {i}: {other} {text}"),
        }
    }
    assert!(
        !accepted.is_empty() && accepted.len() < REQUESTS as usize,
        "{} of {REQUESTS} accepted",
        accepted.len()
    );
    assert!(
        peak <= baseline + BUDGET + OVERHEAD,
        "peak RSS {} MiB: {} MiB at rest, the budget {} MiB and {} MiB overhead",
        peak >> 20,
        baseline >> 20,
        BUDGET >> 20,
        OVERHEAD >> 20
    );
    eprintln!(
        "peak RSS {} MiB ({} MiB at rest), {} of {REQUESTS} accepted",
        peak >> 20,
        baseline >> 20,
        accepted.len()
    );

    // Served normally afterwards.
    let after = post(&client, &url, ndjson(&[reading(1_000)]), None).await;
    assert_eq!(after.status(), 200);
    // Every accepted request's reading landed once, with the warm-up's and the last one.
    let landed = consume(
        &brokers,
        &format!("{prefix}sensor_readings"),
        accepted.len() + 2,
    );
    let mut got: Vec<i64> = landed
        .iter()
        .map(|(value, _)| {
            let v: Value = serde_json::from_slice(value).unwrap();
            v["ts"].as_i64().unwrap() - 1_767_225_600_000
        })
        .collect();
    got.sort_unstable();
    let mut want = accepted.clone();
    want.extend([-1, 1_000]);
    want.sort_unstable();
    assert_eq!(got, want);
    gateway.kill().unwrap();
    gateway.wait().unwrap();
}

/// Past `max_concurrent_requests` a request is answered 429 with `Retry-After` at once, while
/// the requests in progress (slow uplinks) finish, and the gateway serves normally afterwards.
/// A request that needs more memory than the whole `max_inflight_bytes` is answered 413 (no
/// retry would do better), not 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_the_concurrency_limit_are_answered_429_and_the_rest_served() {
    let brokers = env("EDGE_INGEST_KAFKA");
    let dir = tempfile::tempdir().unwrap();
    let (mut gateway, port, _) = spawn_limited(
        &brokers,
        dir.path(),
        "max_concurrent_requests = 2\nrequest_timeout_ms = 30000\nmax_inflight_bytes = 4194304",
    )
    .await;
    let url = format!("http://127.0.0.1:{port}/v1/streams/sensor_readings/records");
    let client = reqwest::Client::new();
    assert_eq!(
        post(&client, &url, ndjson(&[reading(0)]), None)
            .await
            .status(),
        200
    );
    let big: Vec<Value> = (0..60_000).map(|i| reading(10_000 + i)).collect();
    let refused = post(&client, &url, ndjson(&big), None).await;
    assert_eq!(refused.status(), 413);
    let text = refused.text().await.unwrap();
    assert!(text.contains("max_inflight_bytes"), "{text}");
    // Two slow uplinks hold both slots for about 2 s.
    let slow: Vec<_> = (0..2)
        .map(|n| {
            let body = ndjson(&(n * 100 + 1..n * 100 + 60).map(reading).collect::<Vec<_>>());
            tokio::spawn(async move { trickle(port, &body, 2_000).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let refused = post(&client, &url, ndjson(&[reading(500)]), None).await;
    assert_eq!(refused.status(), 429);
    assert!(refused.headers().contains_key("retry-after"));
    let text = refused.text().await.unwrap();
    assert!(text.contains("concurrent requests"), "{text}");
    for s in slow {
        assert_eq!(s.await.unwrap(), 200);
    }
    assert_eq!(
        post(&client, &url, ndjson(&[reading(500)]), None)
            .await
            .status(),
        200
    );
    gateway.kill().unwrap();
    gateway.wait().unwrap();
}

/// The gateway's Kafka password comes from a file and shows nowhere: not in `--check`'s
/// output, nor in its log (debug) through a start, a login and a request that Kafka refuses
/// (tansu takes no SASL login), a SIGHUP reload and a stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kafka_password_comes_from_a_file_and_never_shows() {
    const SECRET: &str = "kafka-pw-5e8d20b3";
    let brokers = env("EDGE_INGEST_KAFKA");
    let dir = tempfile::tempdir().unwrap();
    let password = dir.path().join("kafka-password");
    std::fs::write(&password, format!("{SECRET}\n")).unwrap();
    let port = free_port();
    let prefix = format!("gwsecret{}.", unique());
    let config = dir.path().join("gateway.toml");
    let toml = gateway_toml(port, &brokers, &prefix, &format!("{prefix}dead-letters"), "")
        // Topics made at start would wait for the login, which never succeeds here.
        .replace(
            "create_topics = true\n",
            &format!(
                "create_topics = false\nsasl = {{ mechanism = \"SCRAM-SHA-512\", username = \"u\", password_file = {password:?} }}\n"
            ),
        )
        .replace("produce_timeout_ms = 10000", "produce_timeout_ms = 2000");
    std::fs::write(&config, toml).unwrap();
    let check = Command::new(env!("CARGO_BIN_EXE_ingest-gateway"))
        .args(["--check", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(check.status.success(), "{check:?}");
    assert!(!format!("{check:?}").contains(SECRET), "{check:?}");

    let log = dir.path().join("gateway.log");
    let mut gateway = Command::new(env!("CARGO_BIN_EXE_ingest-gateway"))
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "debug")
        .stdout(std::fs::File::create(dir.path().join("gateway.out")).unwrap())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    listening(port).await;
    let client = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{port}/v1/streams/sensor_readings/records");
    let answer = post(&client, &url, ndjson(&[reading(1)]), None).await;
    assert_eq!(answer.status(), 503, "Kafka takes no login here");
    sighup(&gateway, &log, "SIGHUP: reloaded", 1);
    gateway.kill().unwrap();
    gateway.wait().unwrap();
    let printed = std::fs::read_to_string(&log).unwrap()
        + &std::fs::read_to_string(dir.path().join("gateway.out")).unwrap();
    assert!(printed.contains("SIGHUP: reloaded"));
    assert!(
        printed.contains("Authentication"),
        "the login was tried:\n{printed}"
    );
    assert!(
        !printed.contains(SECRET),
        "the gateway printed its password:\n{printed}"
    );
}
