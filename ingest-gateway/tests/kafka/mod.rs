//! The gateway against Apache Kafka (started by scripts/test.sh, or of a test's own): acks,
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

use crate::common;

use common::kafka::{KafkaCluster, KafkaOptions};
use common::{free_port, proxy};

mod limits;
mod processes;
mod redrive;

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
        admin_listen: None,
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

/// A topic whose `max.message.bytes` is below the producer's refuses a record batch as too
/// large: no retry gets past that, and the 503 it was answered with made a client retry for
/// ever. It is answered 413 (the agent keeps the batch aside); the producer goes on with the
/// next request. The topic is made with a limit of 2 KiB before the gateway starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_the_broker_refuses_as_too_large_is_answered_413() {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let brokers = env("EDGE_INGEST_KAFKA");
    let g = start(&brokers, |c| {
        let topic = format!("{}sensor_readings", c.kafka.topic_prefix);
        let admin: AdminClient<_> = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .create()
            .unwrap();
        let made = futures::executor::block_on(
            admin.create_topics(
                &[NewTopic::new(&topic, 1, TopicReplication::Fixed(1))
                    .set("max.message.bytes", "2048")],
                &AdminOptions::new(),
            ),
        )
        .unwrap();
        made.into_iter().for_each(|r| drop(r.unwrap()));
    })
    .await;
    let client = reqwest::Client::new();
    let url = g.url("sensor_readings");
    let first = post(&client, &url, ndjson(&[reading(1)]), None).await;
    assert_eq!(first.status(), 200);
    // 6,400 hex digits of hashes: zstd cannot take them below 3,200 bytes.
    let mut big = reading(2);
    big["unit"] = Value::String(
        (0..100u32)
            .map(|i| blake3::hash(&i.to_le_bytes()).to_hex().to_string())
            .collect(),
    );
    let refused = post(&client, &url, ndjson(&[big]), None).await;
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

/// A Kafka node of this test's own that advertises `advertised` (the proxy) instead of its
/// own port, so that every client connection goes through the proxy.
fn proxied_kafka(advertised: u16) -> KafkaCluster {
    KafkaCluster::start(KafkaOptions {
        nodes: 1,
        advertised: Some(vec![advertised]),
        ..KafkaOptions::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_outage_answers_503_with_retry_after_then_recovers() {
    service_kit::init_tracing("INGEST_GATEWAY_");
    let front = free_port();
    let broker = proxied_kafka(front);
    let port = broker.nodes[0].port;
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
    drop(broker);
}

/// Stopped while the broker is down and a request waits for its acknowledgement: the request
/// still gets its answer (503 with Retry-After, never 200 and never a dropped connection) once
/// `produce_timeout_ms` has passed, and the gateway stops once it is answered. Before, the
/// answer came up to librdkafka's reconnect backoff (10 s) late: a broker thread that waits to
/// reconnect does not time out its messages meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_a_broker_outage_answers_the_waiting_request_503() {
    let front = free_port();
    let broker = proxied_kafka(front);
    let port = broker.nodes[0].port;
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
    drop(broker);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_listen_moves_metrics_and_health_off_the_api_port() {
    // By default they are on an admin port of their own; "api" puts them on the API's.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("gateway.toml");
    let load = |toml: &str| {
        std::fs::write(&file, toml).unwrap();
        service_kit::load_config::<GatewayConfig>(Some(&file), "ADMINTEST_").unwrap()
    };
    assert_eq!(load("").admin_listen, Some(([0, 0, 0, 0], 9101).into()));
    assert_eq!(load("admin_listen = \"api\"\n").admin_listen, None);
    std::fs::write(&file, "admin_listen = \"9101\"\n").unwrap();
    let refused = service_kit::load_config::<GatewayConfig>(Some(&file), "ADMINTEST_").unwrap_err();
    assert!(
        format!("{refused:#}").contains("nor \"api\""),
        "{refused:#}"
    );

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
        metrics.contains("# HELP gateway_records_total Records of requests"),
        "{metrics}"
    );
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

/// A gateway config on `port` for Kafka at `brokers` (topics `prefix`<stream>, dead letters to
/// `dead_letters`), taking [`TOKEN`], with the TOML of `more` after it.
fn gateway_toml(port: u16, brokers: &str, prefix: &str, dead_letters: &str, more: &str) -> String {
    format!(
        "listen = \"127.0.0.1:{port}\"\nadmin_listen = \"api\"\nstreams_dir = {streams:?}\n\
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
