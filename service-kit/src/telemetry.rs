//! Tracing, the Prometheus recorder and the `/metrics`, `/healthz`, `/readyz` endpoints.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

/// Installs a `tracing` subscriber that logs to stderr, filtered by `RUST_LOG` (default `info`):
/// as text, coloured only on a terminal, or as one JSON object per line with
/// `<env_prefix>LOG_FORMAT=json` (`SINK_LOG_FORMAT=json`, for log shippers).
pub fn init_tracing(env_prefix: &str) {
    init_tracing_with_default(env_prefix, "info");
}

/// Like [`init_tracing`] with another default filter when `RUST_LOG` is unset.
pub fn init_tracing_with_default(env_prefix: &str, default: &str) {
    use std::io::IsTerminal as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let variable = format!("{env_prefix}{LOG_FORMAT}");
    let format = std::env::var(&variable).unwrap_or_default();
    let json = format == "json";
    let _ = JSON_LOGS.set(json);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init()
    };
    if !matches!(format.as_str(), "" | "text" | "json") {
        tracing::warn!(value = %format, "{variable} is neither text nor json; logging text");
    }
}

/// Whether the logs are JSON objects ([`init_tracing`]), so that a fatal error is one too.
pub fn json_logs() -> bool {
    JSON_LOGS.get().copied().unwrap_or(false)
}

static JSON_LOGS: OnceLock<bool> = OnceLock::new();

/// The environment variable that picks the log format, after the binary's prefix
/// (`SINK_LOG_FORMAT`): `text` (the default) or `json`.
pub const LOG_FORMAT: &str = "LOG_FORMAT";

/// Installs the process-wide Prometheus recorder once and returns its handle.
pub fn install_metrics() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = prometheus_builder().build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics may be empty");
            }
            handle
        })
        .clone()
}

/// Durations, in seconds: from a millisecond request to a minute-long upload.
const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Sizes, in bytes: from a 64 KiB file to 1 GiB, by powers of two.
const BYTES_BUCKETS: &[f64] = &[
    65536.0,
    131072.0,
    262144.0,
    524288.0,
    1048576.0,
    2097152.0,
    4194304.0,
    8388608.0,
    16777216.0,
    33554432.0,
    67108864.0,
    134217728.0,
    268435456.0,
    536870912.0,
    1073741824.0,
];

/// Histograms are exported with buckets (`_seconds` and `_bytes` names), not as summaries, so
/// that dashboards can add them up across instances before taking a quantile.
fn prometheus_builder() -> PrometheusBuilder {
    let buckets = [
        (Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS),
        (Matcher::Suffix("_bytes".into()), BYTES_BUCKETS),
    ];
    buckets
        .into_iter()
        .fold(PrometheusBuilder::new(), |builder, (matcher, values)| {
            builder
                .set_buckets_for_metric(matcher, values)
                .expect("bucket lists are not empty")
        })
}

/// Readiness of a component: set once its dependencies are reachable.
#[derive(Debug, Clone, Default)]
pub struct Health {
    ready: Arc<AtomicBool>,
}

impl Health {
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }
}

/// Sets `health` from `check` now and every 5 s until `shutdown`: the readiness probe of the
/// gateway (Kafka reachable) and the sink (Kafka reachable, store writes succeeding).
pub fn spawn_readiness_probe<F, Fut>(health: Health, shutdown: CancellationToken, check: F)
where
    F: Fn() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    tokio::spawn(async move {
        loop {
            health.set_ready(check().await);
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(std::time::Duration::from_secs(5)) => {}
            }
        }
    });
}

/// `/metrics` (Prometheus text), `/healthz` (alive) and `/readyz` (dependencies reachable).
pub fn admin_router(health: Health) -> Router {
    let handle = install_metrics();
    Router::new()
        .route("/metrics", get(move || std::future::ready(handle.render())))
        .route("/healthz", get(|| std::future::ready("ok\n")))
        .route("/readyz", get(readyz))
        .with_state(health)
}

async fn readyz(State(health): State<Health>) -> (StatusCode, &'static str) {
    if health.is_ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

/// Serves the admin router on `addr` until `shutdown` is cancelled. Returns the bound address.
pub async fn serve_admin(
    addr: SocketAddr,
    health: Health,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    serve_admin_with(addr, health, Router::new(), shutdown).await
}

/// [`serve_admin`] with a component's own admin routes (`extra`) next to the common ones.
pub async fn serve_admin_with(
    addr: SocketAddr,
    health: Health,
    extra: Router,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        let options = crate::http::server::ServeOptions::default();
        let router = admin_router(health).merge(extra);
        let result = crate::http::server::serve(listener, router, None, options, shutdown).await;
        if let Err(e) = result {
            tracing::error!(error = %e, "admin server failed");
        }
    });
    Ok(local)
}
/// Creates the counters `names`, with `labels`, at zero: Prometheus sees no increase in a
/// counter whose first sample is already 1, so the first event a dashboard or an alert watches
/// for would go unnoticed. The components call this at start for the series they alert on.
pub fn zero_counters(names: &[&'static str], labels: &[(&'static str, String)]) {
    for &name in names {
        metrics::counter!(name, labels).increment(0);
    }
}

/// Sets the gauges `names`, with `labels`, to `value` (their state before anything happened).
pub fn set_gauges(names: &[&'static str], value: f64, labels: &[(&'static str, String)]) {
    for &name in names {
        metrics::gauge!(name, labels).set(value);
    }
}

/// Declares a component's metric names, each with its kind (`#[counter]`, `#[gauge]` or
/// `#[histogram]`) and its doc comment, and a `describe()` that gives each its `# HELP` line (the doc
/// comment, on one line). `describe` is called once the recorder is installed.
#[macro_export]
macro_rules! metrics {
    ($( #[$kind:ident] $(#[doc = $doc:literal])+ pub const $name:ident: &str = $value:literal; )*) => {
        $( $(#[doc = $doc])+ pub const $name: &str = $value; )*

        /// Gives every metric of this component its `# HELP` line, from its doc comment.
        pub fn describe() {
            $( $crate::metrics!(@describe $kind $name concat!($($doc),+).trim()); )*
        }
    };
    (@describe counter $name:ident $help:expr) => {
        $crate::__metrics::describe_counter!($name, $help)
    };
    (@describe gauge $name:ident $help:expr) => {
        $crate::__metrics::describe_gauge!($name, $help)
    };
    (@describe histogram $name:ident $help:expr) => {
        $crate::__metrics::describe_histogram!($name, $help)
    };
}
