//! Handler tests that need no broker: every request here is refused before producing.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use tower::ServiceExt;

use crate::api::AppState;
use crate::auth::Auth;
use crate::config::{AuthConfig, KafkaConfig, LimitsConfig, TokenConfig};
use crate::produce::Producer;

pub(crate) const TOKEN: &str = "sensor-token";

pub(crate) fn app(limits: LimitsConfig) -> axum::Router {
    let auth = AuthConfig {
        allow_anonymous: false,
        tokens: vec![TokenConfig {
            name: "sensors".into(),
            blake3: blake3::hash(TOKEN.as_bytes()).to_hex().to_string(),
            streams: vec!["sensor_readings".into()],
            max_bytes_per_sec: None,
        }],
    };
    app_with(&auth, limits)
}

fn app_with(auth: &AuthConfig, limits: LimitsConfig) -> axum::Router {
    // No broker at this address: nothing in these tests may reach Kafka.
    let kafka = KafkaConfig {
        brokers: "127.0.0.1:1".into(),
        ..KafkaConfig::default()
    };
    let producer = Producer::new(&kafka, limits.max_inflight_bytes).unwrap();
    let state = Arc::new(AppState::new(
        schemas::example_streams(),
        Auth::from_config(auth).unwrap(),
        limits,
        producer,
        &Default::default(),
    ));
    crate::router(state, Some(service_kit::Health::default()))
}

fn post(
    path: &str,
    token: Option<&str>,
    content_type: &str,
    encoding: Option<&str>,
    body: Vec<u8>,
) -> Request<Body> {
    let mut r = Request::post(path).header("content-type", content_type);
    if let Some(t) = token {
        r = r.header("authorization", format!("Bearer {t}"));
    }
    if let Some(e) = encoding {
        r = r.header("content-encoding", e);
    }
    r.body(Body::from(body)).unwrap()
}

pub(crate) async fn call(app: axum::Router, req: Request<Body>) -> (StatusCode, serde_json::Value) {
    let res = app.oneshot(req).await.unwrap();
    let status = res.status();
    let bytes = axum::body::to_bytes(res.into_body(), 1 << 20)
        .await
        .unwrap();
    let json = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| panic!("{status}: body is not JSON: {bytes:?}"));
    (status, json)
}

const PATH: &str = "/v1/streams/sensor_readings/records";
const NDJSON: &str = "application/x-ndjson";

#[tokio::test]
async fn bad_requests_get_exact_statuses_and_json_errors() {
    let line = br#"{"device_id":"d","sensor":"s","ts":1,"value":1}"#.to_vec();
    let bomb = zstd::encode_all(&vec![b' '; 8 << 20][..], 19).unwrap();
    let limits = LimitsConfig {
        max_body_bytes: 64 << 10,
        max_decompressed_bytes: 1 << 20,
        max_records: 3,
        ..LimitsConfig::default()
    };
    let sensor = schemas::example_streams()
        .get("sensor_readings")
        .unwrap()
        .clone();
    let vehicle = schemas::example_streams()
        .get("vehicle_telemetry")
        .unwrap()
        .clone();
    let record = schemas::check_bytes(&sensor, &line).unwrap().record;
    // 40,000 equal rows: a few KiB of Parquet, megabytes of records.
    let parquet_bomb =
        schemas::columnar::encode_parquet(&sensor, &vec![record; 40_000], 3).unwrap();
    assert!(
        parquet_bomb.len() < 64 << 10,
        "under the body limit: the decoded size trips"
    );
    let vehicle_record = schemas::check_bytes(
        &vehicle,
        br#"{"vehicle_id":"v","recorded_at":1,"lat":1.0,"lon":2.0}"#,
    )
    .unwrap()
    .record;
    let other_stream = schemas::columnar::encode_parquet(&vehicle, &[vehicle_record], 3).unwrap();
    const PARQUET: &str = "application/vnd.apache.parquet";
    let mut bad_key = post(PATH, Some(TOKEN), NDJSON, None, line.clone());
    bad_key
        .headers_mut()
        .insert("idempotency-key", "has space".parse().unwrap());
    let cases: Vec<(&str, Request<Body>, StatusCode, &str)> = vec![
        (
            "bad idempotency key",
            bad_key,
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "no token",
            post(PATH, None, NDJSON, None, line.clone()),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            "wrong token",
            post(PATH, Some("nope"), NDJSON, None, line.clone()),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            "stream not allowed",
            post(
                "/v1/streams/vehicle_telemetry/records",
                Some(TOKEN),
                NDJSON,
                None,
                line.clone(),
            ),
            StatusCode::FORBIDDEN,
            "forbidden",
        ),
        (
            "hostile stream name",
            post(
                "/v1/streams/..%2Fetc%0A/records",
                Some(TOKEN),
                NDJSON,
                None,
                line.clone(),
            ),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "upper-case stream name",
            post(
                "/v1/streams/Sensor/records",
                Some(TOKEN),
                NDJSON,
                None,
                line.clone(),
            ),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "content type",
            post(PATH, Some(TOKEN), "text/csv", None, line.clone()),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        (
            "encoding",
            post(PATH, Some(TOKEN), NDJSON, Some("br"), line.clone()),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        (
            "oversized body",
            post(PATH, Some(TOKEN), NDJSON, None, vec![b'\n'; 65 << 10]),
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
        (
            "zstd bomb",
            post(PATH, Some(TOKEN), NDJSON, Some("zstd"), bomb),
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
        (
            "corrupt zstd",
            post(PATH, Some(TOKEN), NDJSON, Some("zstd"), b"garbage".to_vec()),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "malformed JSON array",
            post(
                PATH,
                Some(TOKEN),
                "application/json",
                None,
                b"[{\"a\":".to_vec(),
            ),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "object instead of array",
            post(PATH, Some(TOKEN), "application/json", None, line.clone()),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "not Parquet",
            post(
                PATH,
                Some(TOKEN),
                PARQUET,
                None,
                b"PAR1garbagePAR1".to_vec(),
            ),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            // Found by fuzzing: the parquet crate panics on its metadata.
            "Parquet that panics the reader",
            post(
                PATH,
                Some(TOKEN),
                PARQUET,
                None,
                include_bytes!("../../schemas/src/testdata/parquet-negative-column-start.bin")
                    .to_vec(),
            ),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "Parquet of another stream",
            post(PATH, Some(TOKEN), PARQUET, None, other_stream),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "Parquet bomb",
            post(PATH, Some(TOKEN), PARQUET, None, parquet_bomb),
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
        (
            "too many records",
            post(
                PATH,
                Some(TOKEN),
                NDJSON,
                None,
                [line.clone(), line.clone(), line.clone(), line.clone()].join(&b'\n'),
            ),
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
    ];
    for (name, req, status, code) in cases {
        let (got, body) = call(app(limits.clone()), req).await;
        assert_eq!(got, status, "{name}: {body}");
        assert_eq!(body["error"], code, "{name}: {body}");
        assert!(
            body["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{name}"
        );
    }
    let req = Request::post("/v1/streams/nope/records")
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-type", NDJSON)
        .body(Body::empty())
        .unwrap();
    // An unknown stream the token is not scoped to is forbidden, not disclosed.
    assert_eq!(
        call(app(limits.clone()), req).await.0,
        StatusCode::FORBIDDEN
    );
}

#[tokio::test]
async fn unknown_stream_is_404_for_a_wildcard_token() {
    let auth = AuthConfig {
        allow_anonymous: false,
        tokens: vec![TokenConfig {
            name: "all".into(),
            blake3: blake3::hash(b"t").to_hex().to_string(),
            streams: vec!["*".into()],
            max_bytes_per_sec: None,
        }],
    };
    let app = app_with(&auth, LimitsConfig::default());
    let (status, body) = call(
        app,
        post("/v1/streams/nope/records", Some("t"), NDJSON, None, vec![]),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["error"], "unknown_stream");
}

#[test]
fn auth_config_errors() {
    let e = Auth::from_config(&AuthConfig::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("allow_anonymous"), "{e}");
    let bad = AuthConfig {
        allow_anonymous: false,
        tokens: vec![TokenConfig {
            name: "x".into(),
            blake3: "abc".into(),
            streams: vec![],
            max_bytes_per_sec: None,
        }],
    };
    assert!(
        Auth::from_config(&bad)
            .unwrap_err()
            .to_string()
            .contains("64 hex digits")
    );
    let zero = AuthConfig {
        allow_anonymous: false,
        tokens: vec![TokenConfig {
            name: "z".into(),
            blake3: blake3::hash(b"z").to_hex().to_string(),
            streams: vec![],
            max_bytes_per_sec: Some(0),
        }],
    };
    let e = Auth::from_config(&zero).unwrap_err().to_string();
    assert!(e.contains("max_bytes_per_sec must be more than 0"), "{e}");
}

#[tokio::test]
async fn a_token_over_its_rate_limit_gets_429_with_retry_after_and_others_do_not() {
    let token = |name: &str, limit: Option<u64>| TokenConfig {
        name: name.into(),
        blake3: blake3::hash(name.as_bytes()).to_hex().to_string(),
        streams: vec!["*".into()],
        max_bytes_per_sec: limit,
    };
    let auth = AuthConfig {
        allow_anonymous: false,
        tokens: vec![token("slow", Some(1_000)), token("free", None)],
    };
    let app = app_with(&auth, LimitsConfig::default());
    // 5,000 bytes that are not zstd: refused as a bad body (no broker needed), but sent all
    // the same, so they count against the token's 1,000 bytes a second.
    let garbage = || vec![b'x'; 5_000];
    let send = |token: &'static str| {
        let app = app.clone();
        async move {
            app.oneshot(post(PATH, Some(token), NDJSON, Some("zstd"), garbage()))
                .await
                .unwrap()
        }
    };
    assert_eq!(send("slow").await.status(), StatusCode::BAD_REQUEST);
    let limited = send("slow").await;
    assert_eq!(limited.status(), StatusCode::TOO_MANY_REQUESTS);
    // 4,000 bytes of debt at 1,000 a second: about 4 seconds.
    let retry: u64 = limited.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((3..=4).contains(&retry), "Retry-After {retry}");
    let body = axum::body::to_bytes(limited.into_body(), 1 << 20)
        .await
        .unwrap();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["error"], "rate_limited");
    // The other token is not held back by the first one's debt.
    for _ in 0..3 {
        assert_eq!(send("free").await.status(), StatusCode::BAD_REQUEST);
    }
}

#[test]
fn shipped_config_file_is_valid() {
    let file =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/ingest-gateway.toml");
    let c: crate::GatewayConfig = service_kit::load_config(Some(&file), "NO_SUCH_PREFIX_").unwrap();
    assert_eq!(
        c.limits.max_body_bytes,
        LimitsConfig::default().max_body_bytes
    );
    assert_eq!(c.auth.tokens.len(), 1);
    assert!(Auth::from_config(&c.auth).is_ok());
    assert_eq!(c.worker_nice, crate::GatewayConfig::default().worker_nice);
}

/// A nice value the gateway cannot set (a higher priority needs privileges) is refused at load.
#[test]
fn negative_worker_nice_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("gateway.toml");
    std::fs::write(&file, "worker_nice = -5\n").unwrap();
    let e = service_kit::load_config::<crate::GatewayConfig>(Some(&file), "NO_SUCH_PREFIX_")
        .unwrap_err();
    assert!(format!("{e:#}").contains("worker_nice"), "{e:#}");
}

#[tokio::test]
async fn unknown_routes_and_methods_answer_json() {
    let res = app(LimitsConfig::default())
        .oneshot(Request::get(PATH).body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::METHOD_NOT_ALLOWED);
    let (status, body) = call(
        app(LimitsConfig::default()),
        Request::get("/nope").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["error"], "not_found");
    let (status, body) = call(
        app(LimitsConfig::default()),
        Request::delete(PATH).body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(body["error"], "method_not_allowed");
}

/// Every librdkafka thread of this process (and rdkafka's polling threads), with its nice value.
fn kafka_thread_nices() -> Vec<(String, i32)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let name = comm.trim();
        if !(name.starts_with("rdk:") || name.starts_with("producer poll")) {
            continue;
        }
        let tid = task.file_name().to_string_lossy().parse().unwrap();
        if let Some(nice) = service_kit::process::nice_of(tid) {
            out.push((name.to_owned(), nice));
        }
    }
    out
}

/// The runtime's workers and blocking threads run `worker_nice` lower; librdkafka's threads keep
/// the priority of the thread that started the gateway, also those of a replacement producer
/// made while a request worker was running.
#[test]
fn request_workers_run_below_the_kafka_threads() {
    std::thread::spawn(|| {
        let base = service_kit::process::thread_nice();
        let lowered = (base + 5).min(19);
        let runtime = crate::runtime(5).unwrap();
        runtime.block_on(async {
            let kafka = KafkaConfig {
                brokers: "127.0.0.1:1".into(),
                ..KafkaConfig::default()
            };
            let producer = Arc::new(Producer::new(&kafka, 1 << 20).unwrap());
            let p = producer.clone();
            let (worker, fresh) =
                tokio::spawn(
                    async move { (service_kit::process::thread_nice(), p.fresh_instance()) },
                )
                .await
                .unwrap();
            assert_eq!(worker, lowered, "a request worker");
            let blocking = tokio::task::spawn_blocking(service_kit::process::thread_nice)
                .await
                .unwrap();
            assert_eq!(blocking, lowered, "a blocking-pool thread");
            let fresh = fresh.unwrap();
            // Two producers: librdkafka's main and broker threads and rdkafka's pollers (a
            // poller thread may take a moment to start).
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            let mut threads = kafka_thread_nices();
            while threads.len() < 6 && std::time::Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                threads = kafka_thread_nices();
            }
            assert!(threads.len() >= 6, "{threads:?}");
            for (name, nice) in &threads {
                assert_eq!(*nice, base, "thread {name}: {threads:?}");
            }
            drop(fresh);
        });
        assert_eq!(
            service_kit::process::thread_nice(),
            base,
            "the starting thread"
        );
    })
    .join()
    .unwrap();
}

/// Every answer carries an `x-request-id`: the client's own, or a new UUID per request.
#[tokio::test]
async fn answers_carry_the_request_id() {
    let id = |res: &axum::response::Response| {
        res.headers()
            .get("x-request-id")
            .map(|v| v.to_str().unwrap().to_owned())
    };
    let anonymous = || post(PATH, None, NDJSON, None, b"{}".to_vec());
    let first = app(LimitsConfig::default())
        .oneshot(anonymous())
        .await
        .unwrap();
    let second = app(LimitsConfig::default())
        .oneshot(anonymous())
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::UNAUTHORIZED);
    let (a, b) = (id(&first).unwrap(), id(&second).unwrap());
    assert_eq!(a.len(), 36, "{a}");
    assert_ne!(a, b);
    let mut own = post(PATH, Some(TOKEN), "text/plain", None, b"{}".to_vec());
    own.headers_mut()
        .insert("x-request-id", "box-7/batch-42".parse().unwrap());
    let res = app(LimitsConfig::default()).oneshot(own).await.unwrap();
    assert_eq!(res.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(id(&res).as_deref(), Some("box-7/batch-42"));
}
