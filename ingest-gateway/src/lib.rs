//! The ingest gateway: an HTTP front door that authenticates, decodes and validates records and
//! produces them to Kafka, answering only after Kafka acknowledged them.

pub mod api;
pub mod auth;
pub mod cli;
pub mod config;
pub mod error;
pub mod idempotency;
pub mod metrics;
pub mod produce;
pub mod redrive;
pub mod registry;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::Router;
use axum::extract::{MatchedPath, Request};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use schemas::Streams;
use service_kit::Health;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use config::GatewayConfig;

use crate::api::AppState;
use crate::auth::Auth;
use crate::produce::Producer;

/// The Tokio runtime to serve a gateway on: its threads (request handling and blocking work)
/// run `worker_nice` above the nice value of the thread that builds it. Build it and call
/// [`start`] inside `block_on` on a thread at the process's priority: the Kafka clients are
/// created there, so librdkafka's threads keep that priority.
pub fn runtime(worker_nice: u8) -> std::io::Result<tokio::runtime::Runtime> {
    let base = service_kit::process::thread_nice();
    let target = (base + i32::from(worker_nice)).min(19);
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if target > base {
        builder.on_thread_start(move || {
            if let Err(e) = service_kit::process::set_thread_nice(target) {
                tracing::warn!(error = %e, nice = target, "cannot lower a worker thread's priority");
            }
        });
    }
    builder.build()
}

/// A started gateway.
pub struct Gateway {
    /// The address the API listens on.
    pub addr: SocketAddr,
    /// The address of `/metrics`, `/healthz` and `/readyz` when `admin_listen` puts them on a
    /// listener of their own.
    pub admin_addr: Option<SocketAddr>,
    /// Ends when the server stopped (after `shutdown` and draining).
    pub task: JoinHandle<anyhow::Result<()>>,
    /// Puts new tokens and a new certificate in force (the binary on SIGHUP).
    pub reload: Reload,
}

/// What a running gateway takes again from its config without a restart: the tokens of
/// `[auth]`, the certificate, key and client CA files of `[tls]` (certificates are renewed on
/// their own schedule, a leaked token must stop working now) and the stream definitions of
/// `streams_dir` (new streams, compatible changes, new zstd dictionaries). Other settings take
/// effect at the next start. Connections and requests in progress are not disturbed: a request
/// keeps the tokens and definition it began with, a TLS session the certificate it was made
/// with.
#[derive(Clone)]
pub struct Reload {
    state: Arc<AppState>,
    tls: Option<service_kit::http::server::RustlsConfig>,
}

/// What a [`Reload`] put in force.
#[derive(Debug)]
pub struct Reloaded {
    pub tokens: usize,
    /// Streams defined anew, their topics created if `kafka.create_topics`.
    pub added: Vec<String>,
    /// Streams whose definition changed compatibly.
    pub changed: Vec<String>,
}

impl Reload {
    /// Puts `config`'s tokens, TLS files and stream definitions in force, once all of them are
    /// read and valid (a stream's definition changed incompatibly is not: a new version of a
    /// stream is a new stream) and the topics of new streams exist; otherwise nothing changes.
    pub async fn apply(&self, config: &GatewayConfig) -> anyhow::Result<Reloaded> {
        let auth = Auth::from_config(&config.auth)?;
        let tls = match (&self.tls, &config.tls) {
            (Some(running), Some(files)) => {
                let server = files
                    .server_config()
                    .with_context(|| format!("tls: cannot load {}", files.cert.display()))?;
                Some((running, server))
            }
            (None, None) => None,
            _ => anyhow::bail!("TLS is turned on or off only at a restart"),
        };
        let (added, changed) =
            put_definitions_in_force(&self.state, &config.streams_dir, &config.kafka).await?;
        self.state.set_auth(auth);
        if let Some((running, server)) = tls {
            running.reload_from_config(Arc::new(server));
        }
        self.state
            .follow_definitions(config.streams_dir.clone(), config.kafka.clone());
        Ok(Reloaded {
            tokens: config.auth.tokens.len(),
            added,
            changed,
        })
    }
}

/// Reads the definitions of `dir` and puts them in force ([`schemas::Streams::updated_by`]):
/// new streams (their topics created first when `kafka.create_topics`) and compatible changes,
/// or nothing when a change is incompatible. Returns the streams added and changed.
pub async fn put_definitions_in_force(
    state: &AppState,
    dir: &std::path::Path,
    kafka: &config::KafkaConfig,
) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    let dir = dir.to_path_buf();
    let loaded = tokio::task::spawn_blocking(move || service_kit::load_streams_dir(&dir)).await??;
    let update = state
        .streams()
        .updated_by(loaded)
        .map_err(|e| anyhow::anyhow!("{e}; a new version of a stream needs a new stream"))?;
    if !update.added.is_empty() {
        let mut added = update.streams.clone();
        added.retain(|def| update.added.contains(&def.name));
        metrics::register(&added);
        if kafka.create_topics {
            produce::ensure_topics(kafka, &added).await?;
        }
    }
    state.set_streams(update.streams);
    Ok((update.added, update.changed))
}

/// Loads the definition of `stream` alone from `dir` (with its dictionaries, a file being
/// written read whole: [`service_kit::load_stream`]) and puts it in force beside the streams in
/// force, its topic created first when `kafka.create_topics`: a stream defined after the start,
/// at its first request. A broken file of another stream does not keep it out.
pub async fn put_stream_in_force(
    state: &AppState,
    dir: &std::path::Path,
    stream: &str,
    kafka: &config::KafkaConfig,
) -> anyhow::Result<()> {
    let (dir, name) = (dir.to_path_buf(), stream.to_owned());
    let def = tokio::task::spawn_blocking(move || service_kit::load_stream(&dir, &name)).await??;
    let mut added = schemas::Streams::default();
    added.insert(def.clone());
    metrics::register(&added);
    if kafka.create_topics {
        produce::ensure_topics(kafka, &added).await?;
    }
    let mut streams = state.streams();
    streams.insert(def);
    state.set_streams(streams);
    Ok(())
}

/// Builds the router: the ingest API, plus `/metrics`, `/healthz` and `/readyz` when `admin` is
/// given (they are served on the API's listener).
pub fn router(state: Arc<AppState>, admin: Option<Health>) -> Router {
    let drain = service_kit::http::drain::Drain {
        max_bytes: state.limits.max_body_bytes,
        max_time: std::time::Duration::from_millis(state.limits.request_timeout_ms),
    };
    let api = Router::new()
        .route("/v1/streams/{stream}/records", post(api::ingest))
        .route("/registry/subjects", get(registry::subjects))
        .route("/registry/subjects/{subject}", post(registry::lookup))
        .route(
            "/registry/subjects/{subject}/versions",
            get(registry::versions).post(registry::register),
        )
        .route(
            "/registry/subjects/{subject}/versions/{version}",
            get(registry::version),
        )
        .route("/registry/schemas/ids/{id}", get(registry::schema))
        .route("/registry/schemas/types", get(registry::types))
        .route("/registry/config", get(registry::config))
        .route("/registry/config/{subject}", get(registry::config))
        .route(
            "/registry/compatibility/subjects/{subject}/versions/{version}",
            post(registry::compatibility),
        )
        .with_state(state)
        .route("/openapi.json", get(openapi));
    match admin {
        Some(health) => api.merge(service_kit::admin_router(health)),
        None => api,
    }
    .fallback(api::not_found)
    .method_not_allowed_fallback(api::method_not_allowed)
    // A refused body is read to its end (to a bound) so that the client sees the answer.
    .layer(middleware::from_fn_with_state(
        drain,
        service_kit::http::drain::drain_unread,
    ))
    .layer(middleware::from_fn(track_requests))
    // Outermost: every request gets an `x-request-id` (the client's own, or a new UUID), and
    // every answer carries it back, for a client to quote and the logs to find.
    .layer(tower_http::request_id::PropagateRequestIdLayer::x_request_id())
    .layer(tower_http::request_id::SetRequestIdLayer::x_request_id(
        tower_http::request_id::MakeRequestUuid,
    ))
}

/// The OpenAPI 3 description of the API.
pub const OPENAPI: &str = include_str!("../openapi.json");

async fn openapi() -> impl axum::response::IntoResponse {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        OPENAPI,
    )
}

async fn track_requests(request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |p| match p.as_str() {
            "/v1/streams/{stream}/records" => "records",
            "/metrics" => "metrics",
            "/healthz" => "healthz",
            "/readyz" => "readyz",
            "/openapi.json" => "openapi",
            p if p.starts_with("/registry/") => "registry",
            _ => "other",
        });
    // Cheap copies (reference-counted): the id and the path are rendered only for a failure.
    let request_id = request.headers().get("x-request-id").cloned();
    let (method, uri) = (request.method().clone(), request.uri().clone());
    let started = Instant::now();
    let response = next.run(request).await;
    let code = response.status();
    if code.is_client_error() || code.is_server_error() {
        log_failed(code, request_id.as_ref(), &method, &uri);
    }
    let status = code.as_u16().to_string();
    ::metrics::counter!(metrics::HTTP_REQUESTS, "route" => route, "status" => status).increment(1);
    ::metrics::histogram!(metrics::HTTP_DURATION, "route" => route)
        .record(started.elapsed().as_secs_f64());
    response
}

/// Logs a failed request with the id the client got back: 5xx as warnings, 4xx (a client's
/// mistake, or an attack's) only with RUST_LOG=ingest_gateway=debug.
fn log_failed(
    code: axum::http::StatusCode,
    request_id: Option<&axum::http::HeaderValue>,
    method: &axum::http::Method,
    uri: &axum::http::Uri,
) {
    let request_id = request_id
        .and_then(|v| v.to_str().ok())
        .map(schemas::stream::printable)
        .unwrap_or_default();
    let path = schemas::stream::printable(uri.path());
    if code.is_server_error() {
        tracing::warn!(%request_id, %method, %path, status = code.as_u16(), "request failed");
    } else {
        tracing::debug!(%request_id, %method, %path, status = code.as_u16(), "request refused");
    }
}

/// Checks what `start` would refuse, without connecting to Kafka or listening: the tokens, the
/// Kafka client settings (TLS and SASL files included) and the server certificate. Returns the
/// number of streams served.
pub fn check(config: &GatewayConfig, streams: &Streams) -> anyhow::Result<usize> {
    Auth::from_config(&config.auth)?;
    let mut kafka = rdkafka::ClientConfig::new();
    produce::configure(&mut kafka, &config.kafka)?;
    if let Some(tls) = &config.tls {
        tls.server_config()
            .with_context(|| format!("tls: cannot load {}", tls.cert.display()))?;
    }
    Ok(streams.iter().count())
}

/// Starts the gateway: creates topics if configured, binds the listener and serves until
/// `shutdown` is cancelled, then drains in-flight requests and flushes the producer.
pub async fn start(
    config: GatewayConfig,
    streams: Streams,
    shutdown: CancellationToken,
) -> anyhow::Result<Gateway> {
    metrics::register(&streams);
    let auth = Auth::from_config(&config.auth).map_err(service_kit::config::invalid)?;
    if config.auth.allow_anonymous {
        tracing::warn!("anonymous ingest is allowed (auth.allow_anonymous = true)");
    }
    if config.kafka.create_topics {
        produce::ensure_topics(&config.kafka, &streams).await?;
    }
    let producer = Producer::new(&config.kafka, config.limits.max_inflight_bytes)?;
    let limits = config::LimitsConfig {
        max_message_bytes: producer.max_message_bytes(),
        ..config.limits.clone()
    };
    let state = Arc::new(
        AppState::new(streams, auth, limits, producer, &config.idempotency).with_registry(
            registry::Registry::new(&config.registry, &config.kafka.topic_prefix)?,
        ),
    );
    state.follow_definitions(config.streams_dir.clone(), config.kafka.clone());
    let health = Health::default();
    let probed = state.clone();
    service_kit::spawn_readiness_probe(health.clone(), shutdown.clone(), move || {
        let state = probed.clone();
        async move { state.producer.is_reachable().await }
    });
    let listener = std::net::TcpListener::bind(config.listen)
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let admin_addr = match config.admin_listen {
        Some(admin) => Some(
            service_kit::serve_admin(admin, health.clone(), shutdown.clone())
                .await
                .with_context(|| format!("cannot listen on {admin} (admin_listen)"))?,
        ),
        None => None,
    };
    let app = router(state.clone(), admin_addr.is_none().then_some(health));
    let tls = match &config.tls {
        Some(tls) => Some(tls.load().await?),
        None => None,
    };
    tracing::info!(%addr, tls = tls.is_some(), brokers = %config.kafka.brokers, "gateway listening");
    let options = service_kit::http::server::ServeOptions {
        header_timeout: Duration::from_millis(config.limits.header_timeout_ms.max(1)),
        max_connections: config.limits.max_connections,
        metrics: Some(service_kit::http::server::ConnectionMetrics {
            open: metrics::OPEN_CONNECTIONS,
            refused: metrics::REFUSED_CONNECTIONS,
        }),
    };
    let reload = Reload {
        state: state.clone(),
        tls: tls.clone(),
    };
    let task = tokio::spawn(async move {
        service_kit::http::server::serve(listener, app, tls, options, shutdown).await?;
        state.producer.flush(Duration::from_secs(10)).await;
        tracing::info!("gateway stopped");
        Ok(())
    });
    Ok(Gateway {
        addr,
        admin_addr,
        task,
        reload,
    })
}

#[cfg(test)]
mod tests;
