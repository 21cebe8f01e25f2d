//! Serving an axum router on a listener, over plain HTTP or TLS (rustls), until shutdown: the
//! gateway's API, the edge agent's local ingest port and every component's admin endpoints.
//!
//! A connection must send each request head within [`ServeOptions::header_timeout`], the first
//! one and every later one on a kept-alive connection: a client that connects and sends nothing,
//! trickles its headers (slowloris) or keeps an idle connection open is disconnected, instead of
//! holding a connection, a task and its buffers for good. hyper's header timeout starts only
//! once a connection is known to be HTTP/1, which takes its first bytes, and HTTP/2 has none,
//! so [`ConnectionGuard`] also closes a connection (after its TLS handshake, which has its own
//! 10 s limit) that has had no request in flight and started none for that time: a silent one,
//! or an HTTP/2 one that only answers pings. HTTP/2 connections are pinged every half of that
//! time and closed when the peer does not answer within it.
//!
//! At most [`ServeOptions::max_connections`] connections are open at once; one more is closed
//! as it is accepted (before any TLS work), so many clients cost a bounded number of
//! connections, tasks and buffers.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum_server::accept::Accept;
/// A server's TLS settings as it serves them: [`TlsConfig::load`] makes one, and
/// `reload_from_config` puts a new certificate in force for the connections made after.
pub use axum_server::tls_rustls::RustlsConfig;
use rustls_pki_types::PrivateKeyDer;
use rustls_pki_types::pem::PemObject;
use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::CancellationToken;

use crate::tls::pem_certificates;

/// A server certificate: `[tls]` of the gateway, `tls` of the agent's HTTP source.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate chain.
    pub cert: PathBuf,
    /// PEM private key.
    pub key: PathBuf,
    /// Mutual TLS: PEM CA certificates; only clients presenting a certificate issued by one of
    /// them get a TLS session (the handshake fails for the others).
    #[serde(default)]
    pub client_ca_file: Option<PathBuf>,
}

impl TlsConfig {
    /// The rustls server config: the certificate and key, which must go together, and the
    /// client certificate check when `client_ca_file` is given. HTTP/2 and HTTP/1.1 by ALPN.
    pub fn server_config(&self) -> anyhow::Result<rustls::ServerConfig> {
        let chain = pem_certificates(&self.cert)?;
        let key = PrivateKeyDer::from_pem_file(&self.key)
            .with_context(|| format!("cannot read a private key from {}", self.key.display()))?;
        let builder = rustls::ServerConfig::builder();
        let builder = match &self.client_ca_file {
            None => builder.with_no_client_auth(),
            Some(path) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in pem_certificates(path)? {
                    roots.add(cert).with_context(|| {
                        format!("a certificate of {} is invalid", path.display())
                    })?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder(Arc::new(roots))
                    .build()
                    .with_context(|| format!("cannot verify clients with {}", path.display()))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_single_cert(chain, key).with_context(|| {
            format!(
                "{} is not the key of {}",
                self.key.display(),
                self.cert.display()
            )
        })?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
    }

    /// Reads the certificate and key (at start, so that a bad file stops the start).
    pub async fn load(&self) -> anyhow::Result<RustlsConfig> {
        let config = self.server_config().with_context(|| {
            format!(
                "cannot load TLS certificate {} and key {}",
                self.cert.display(),
                self.key.display()
            )
        })?;
        Ok(RustlsConfig::from_config(Arc::new(config)))
    }
}

/// How connections are served.
#[derive(Debug, Clone, Copy)]
pub struct ServeOptions {
    /// Longest time a connection may take to send a request head, and may stay without a
    /// request in flight (see the module's docs).
    pub header_timeout: Duration,
    /// Connections open at once; more are closed as they come.
    pub max_connections: usize,
    /// Metric names for the open connections (a gauge) and those closed at the limit (a
    /// counter); none for servers whose component does not report them.
    pub metrics: Option<ConnectionMetrics>,
}

/// See [`ServeOptions::metrics`].
#[derive(Debug, Clone, Copy)]
pub struct ConnectionMetrics {
    pub open: &'static str,
    pub refused: &'static str,
}

/// hyper's own default header timeout, which takes effect only with a timer, as here.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// The default of [`ServeOptions::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            metrics: None,
        }
    }
}

/// Serves `app` on `listener` (non-blocking), with TLS when `tls` is given, until `shutdown`;
/// requests in progress are finished.
pub async fn serve(
    listener: std::net::TcpListener,
    app: Router,
    tls: Option<RustlsConfig>,
    options: ServeOptions,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let handle = axum_server::Handle::new();
    let stopper = handle.clone();
    tokio::spawn(async move {
        shutdown.cancelled().await;
        stopper.graceful_shutdown(None);
    });
    let service = app.into_make_service();
    let slots = Arc::new(tokio::sync::Semaphore::new(options.max_connections.max(1)));
    match tls {
        None => {
            let server = axum_server::from_tcp(listener)?.handle(handle);
            let mut server = server.map(|inner| ConnectionGuard::new(inner, options, &slots));
            set_up(server.http_builder(), options);
            server.serve(service).await?;
        }
        Some(tls) => {
            let server = axum_server::from_tcp_rustls(listener, tls)?.handle(handle);
            let mut server = server.map(|inner| ConnectionGuard::new(inner, options, &slots));
            set_up(server.http_builder(), options);
            server.serve(service).await?;
        }
    }
    Ok(())
}

/// An acceptor that takes one of the connection slots for each connection of `inner` (closing
/// it when none is free) and hands it on as a [`GuardedStream`].
#[derive(Debug, Clone)]
struct ConnectionGuard<A> {
    inner: A,
    options: ServeOptions,
    slots: Arc<tokio::sync::Semaphore>,
    /// Connections closed for want of a slot since the last warning, and when that was.
    refused: Arc<std::sync::Mutex<(u64, Option<std::time::Instant>)>>,
}

impl<A> ConnectionGuard<A> {
    fn new(inner: A, options: ServeOptions, slots: &Arc<tokio::sync::Semaphore>) -> Self {
        ConnectionGuard {
            inner,
            options,
            slots: slots.clone(),
            refused: Arc::default(),
        }
    }

    fn warn_refused(&self) {
        if let Some(names) = self.options.metrics {
            metrics::counter!(names.refused).increment(1);
        }
        let mut refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        refused.0 += 1;
        if refused
            .1
            .is_none_or(|at| at.elapsed() >= Duration::from_secs(10))
        {
            tracing::warn!(
                max_connections = self.options.max_connections,
                closed = refused.0,
                "connection limit reached; closing new connections"
            );
            *refused = (0, Some(std::time::Instant::now()));
        }
    }
}

impl<A, I, S> Accept<I, S> for ConnectionGuard<A>
where
    A: Accept<I, S>,
    A::Future: Send + 'static,
{
    type Stream = GuardedStream<A::Stream>;
    type Service = Counted<A::Service>;
    type Future = Pin<
        Box<dyn Future<Output = std::io::Result<(Self::Stream, Self::Service)>> + Send + 'static>,
    >;

    fn accept(&self, stream: I, service: S) -> Self::Future {
        let Ok(permit) = self.slots.clone().try_acquire_owned() else {
            drop(stream);
            self.warn_refused();
            return Box::pin(async { Err(std::io::Error::other("connection limit reached")) });
        };
        let slot = Slot::new(permit, self.options.metrics);
        let accepted = self.inner.accept(stream, service);
        let idle = self.options.header_timeout;
        Box::pin(async move {
            let (stream, service) = accepted.await?;
            let activity = Arc::new(Activity::new());
            let stream = GuardedStream {
                stream,
                activity: activity.clone(),
                timer: Box::pin(tokio::time::sleep(idle)),
                idle,
                _slot: slot,
            };
            Ok((
                stream,
                Counted {
                    inner: service,
                    activity,
                },
            ))
        })
    }
}

/// What a connection's requests are doing: how many are being answered, and when the last one
/// started or ended.
struct Activity {
    accepted: std::time::Instant,
    in_flight: std::sync::atomic::AtomicUsize,
    /// Milliseconds after `accepted`.
    last_ms: std::sync::atomic::AtomicU64,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            accepted: std::time::Instant::now(),
            in_flight: Default::default(),
            last_ms: Default::default(),
        }
    }

    fn touch(&self) {
        let ms = self.accepted.elapsed().as_millis() as u64;
        self.last_ms.store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// When the connection has been idle for `idle`: none in flight, none since.
    fn idle_until(&self, idle: Duration) -> Option<std::time::Instant> {
        use std::sync::atomic::Ordering::Relaxed;
        (self.in_flight.load(Relaxed) == 0)
            .then(|| self.accepted + Duration::from_millis(self.last_ms.load(Relaxed)) + idle)
    }
}

/// A connection's service, counting its requests in its [`Activity`].
#[derive(Clone)]
struct Counted<S> {
    inner: S,
    activity: Arc<Activity>,
}

/// A request being answered, until its answer is made (or dropped).
struct Busy(Arc<Activity>);

impl Busy {
    fn new(activity: Arc<Activity>) -> Busy {
        activity
            .in_flight
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        activity.touch();
        Busy(activity)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.touch();
        self.0
            .in_flight
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl<S, R> tower::Service<R> for Counted<S>
where
    S: tower::Service<R>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        let busy = Busy::new(self.activity.clone());
        let answer = self.inner.call(request);
        Box::pin(async move {
            let _busy = busy;
            answer.await
        })
    }
}

/// One of the connection slots, taken from accepting a connection (before its TLS handshake)
/// until it closes, counted in the open connections' gauge.
struct Slot {
    _permit: tokio::sync::OwnedSemaphorePermit,
    open: Option<&'static str>,
}

impl Slot {
    fn new(permit: tokio::sync::OwnedSemaphorePermit, names: Option<ConnectionMetrics>) -> Slot {
        let open = names.map(|n| n.open);
        if let Some(open) = open {
            metrics::gauge!(open).increment(1.0);
        }
        Slot {
            _permit: permit,
            open,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(open) = self.open {
            metrics::gauge!(open).decrement(1.0);
        }
    }
}

/// A connection holding its slot, whose reads fail with `TimedOut` once it has been idle (no
/// request answered, none started) for the header timeout: a connection that never sends a
/// request (whatever its protocol: hyper's own header timeout starts only once the first bytes
/// told HTTP/1 from HTTP/2), or an HTTP/2 one that only answers pings.
struct GuardedStream<S> {
    stream: S,
    activity: Arc<Activity>,
    timer: Pin<Box<tokio::time::Sleep>>,
    idle: Duration,
    _slot: Slot,
}

impl<S> GuardedStream<S> {
    /// Whether the connection has been idle too long; otherwise the timer is set to wake this
    /// task when it might have been.
    fn idle_too_long(&mut self, cx: &mut Context<'_>) -> bool {
        while self.timer.as_mut().poll(cx).is_ready() {
            let now = tokio::time::Instant::now();
            match self.activity.idle_until(self.idle) {
                Some(until) if until <= now.into_std() => return true,
                Some(until) => self.timer.as_mut().reset(until.into()),
                None => self.timer.as_mut().reset(now + self.idle),
            }
        }
        false
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for GuardedStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let read = Pin::new(&mut self.stream).poll_read(cx, buf);
        if read.is_pending() && self.idle_too_long(cx) {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no request within the header timeout",
            )));
        }
        read
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for GuardedStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

fn set_up(
    builder: &mut hyper_util::server::conn::auto::Builder<hyper_util::rt::TokioExecutor>,
    options: ServeOptions,
) {
    let timer = hyper_util::rt::TokioTimer::new;
    builder
        .http1()
        .timer(timer())
        .header_read_timeout(options.header_timeout);
    builder
        .http2()
        .timer(timer())
        .keep_alive_interval(options.header_timeout / 2)
        .keep_alive_timeout(options.header_timeout);
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;

    const TIMEOUT: Duration = Duration::from_millis(600);

    /// Serves a router answering `ok` on `/` on a loopback port with `options`.
    fn ok_server(options: ServeOptions) -> (std::net::SocketAddr, CancellationToken) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let slow = || async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            "slow"
        };
        let app = Router::new()
            .route("/", axum::routing::get(|| async { "ok" }))
            .route("/slow", axum::routing::get(slow));
        let shutdown = CancellationToken::new();
        tokio::spawn(serve(listener, app, None, options, shutdown.clone()));
        (addr, shutdown)
    }

    /// Sends a GET on `conn` and returns the start of the answer (empty when it was closed).
    async fn get(conn: &mut TcpStream) -> String {
        let _ = conn.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n").await;
        let mut answer = [0u8; 512];
        let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut answer))
            .await
            .expect("no answer and not closed")
            .unwrap_or(0);
        String::from_utf8_lossy(&answer[..n]).into_owned()
    }

    /// An HTTP/2 connection (prior knowledge, plain TCP) that sends one request, then only
    /// acknowledges the server's settings and answers its pings, as any HTTP/2 client library
    /// does by itself, is closed once it has had no request for the header timeout.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_http2_connection_that_only_answers_pings_is_closed() {
        const TIMEOUT: Duration = Duration::from_millis(500);
        let (addr, shutdown) = ok_server(ServeOptions {
            header_timeout: TIMEOUT,
            ..ServeOptions::default()
        });
        let mut conn = TcpStream::connect(addr).await.unwrap();
        // The preface and empty settings, then GET / on stream 1 (HPACK: :method GET = 0x82,
        // :path / = 0x84, :scheme http = 0x86, :authority t = literal without indexing of
        // name 1).
        let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        hello.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
        let block = [0x82, 0x84, 0x86, 0x01, 0x01, b't'];
        hello.extend_from_slice(&[0, 0, block.len() as u8, 1, 0x05, 0, 0, 0, 1]);
        hello.extend_from_slice(&block);
        conn.write_all(&hello).await.unwrap();
        let started = Instant::now();
        let (mut pings, mut answered) = (0, false);
        let closed = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let mut head = [0u8; 9];
                if conn.read_exact(&mut head).await.is_err() {
                    return;
                }
                let len =
                    usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
                let mut payload = vec![0u8; len];
                if conn.read_exact(&mut payload).await.is_err() {
                    return;
                }
                let (kind, flags) = (head[3], head[4]);
                let reply = match (kind, flags & 1) {
                    (1, _) => {
                        answered = true;
                        None
                    }
                    // SETTINGS: acknowledge.
                    (4, 0) => Some(vec![0, 0, 0, 4, 1, 0, 0, 0, 0]),
                    // PING: answer with its payload.
                    (6, 0) => {
                        pings += 1;
                        let mut ack = vec![0, 0, 8, 6, 1, 0, 0, 0, 0];
                        ack.extend_from_slice(&payload);
                        Some(ack)
                    }
                    _ => None,
                };
                if let Some(reply) = reply
                    && conn.write_all(&reply).await.is_err()
                {
                    return;
                }
            }
        });
        assert!(
            closed.await.is_ok(),
            "the idle HTTP/2 connection stayed open"
        );
        let lasted = started.elapsed();
        assert!(answered, "the request got no answer");
        assert!(
            lasted >= TIMEOUT && lasted < TIMEOUT * 8,
            "lasted {lasted:?}"
        );
        assert!(pings >= 1, "the server sent no ping to answer");
        shutdown.cancel();
    }

    /// A request answered after three header timeouts is not cut: a connection with a request
    /// in flight is not idle.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_answer_is_not_cut_by_the_idle_rule() {
        let (addr, shutdown) = ok_server(ServeOptions {
            header_timeout: Duration::from_millis(500),
            ..ServeOptions::default()
        });
        let mut conn = TcpStream::connect(addr).await.unwrap();
        conn.write_all(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let mut answer = [0u8; 512];
        let n = conn.read(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.ends_with("slow"),
            "{answer}"
        );
        shutdown.cancel();
    }

    /// The value of the unlabelled series `name` in the process's `/metrics` text.
    fn metric(name: &str) -> f64 {
        let text = crate::install_metrics().render();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
    }

    /// Past `max_connections` a new connection is closed at once, and counted; once one closes,
    /// its slot takes the next.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connections_past_the_limit_are_closed_until_a_slot_frees() {
        const OPEN: &str = "server_test_open_connections";
        const REFUSED: &str = "server_test_refused_connections_total";
        crate::install_metrics();
        let (addr, shutdown) = ok_server(ServeOptions {
            max_connections: 2,
            metrics: Some(ConnectionMetrics {
                open: OPEN,
                refused: REFUSED,
            }),
            ..ServeOptions::default()
        });
        let mut first = TcpStream::connect(addr).await.unwrap();
        let mut second = TcpStream::connect(addr).await.unwrap();
        assert!(get(&mut first).await.starts_with("HTTP/1.1 200"));
        assert!(get(&mut second).await.starts_with("HTTP/1.1 200"));
        assert_eq!(metric(OPEN), 2.0);
        let mut third = TcpStream::connect(addr).await.unwrap();
        assert_eq!(get(&mut third).await, "", "a third connection was served");
        assert_eq!(metric(REFUSED), 1.0);
        assert_eq!(metric(OPEN), 2.0);
        drop(first);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let mut next = TcpStream::connect(addr).await.unwrap();
            if get(&mut next).await.starts_with("HTTP/1.1 200") {
                break;
            }
            assert!(Instant::now() < deadline, "the freed slot was not taken");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(get(&mut second).await.starts_with("HTTP/1.1 200"));
        shutdown.cancel();
    }

    /// Reads until the server closes the connection (or 10 s pass); returns what it sent and
    /// how long the connection lasted from `since`.
    async fn until_closed(conn: &mut TcpStream, since: Instant) -> (String, Duration) {
        let mut got = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), async {
            let mut buf = [0u8; 1024];
            while let Ok(n @ 1..) = conn.read(&mut buf).await {
                got.extend_from_slice(&buf[..n]);
            }
        });
        assert!(read.await.is_ok(), "the server kept the connection open");
        (String::from_utf8_lossy(&got).into_owned(), since.elapsed())
    }

    /// A connection that sends nothing, one that trickles its header a byte at a time and one
    /// left idle after a request are closed after the header timeout, while a prompt client is
    /// served all along.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn silent_trickling_and_idle_connections_are_closed_after_the_header_timeout() {
        let (addr, shutdown) = ok_server(ServeOptions {
            header_timeout: TIMEOUT,
            ..ServeOptions::default()
        });
        let started = Instant::now();
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let mut trickling = TcpStream::connect(addr).await.unwrap();
        let trickle = tokio::spawn(async move {
            for b in b"GET / HTTP/1.1\r\nHost: t\r\nX-Slow: ".iter().cycle() {
                if trickling.write_all(&[*b]).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            until_closed(&mut trickling, started).await
        });
        let mut idle = TcpStream::connect(addr).await.unwrap();
        assert!(get(&mut idle).await.starts_with("HTTP/1.1 200"));
        let idle_since = Instant::now();
        // A prompt client is served while the others hold their connections.
        for _ in 0..3 {
            let mut prompt = TcpStream::connect(addr).await.unwrap();
            assert!(get(&mut prompt).await.starts_with("HTTP/1.1 200"));
        }

        let (_, lasted) = until_closed(&mut silent, started).await;
        assert!(
            lasted >= TIMEOUT && lasted < TIMEOUT * 8,
            "silent: {lasted:?}"
        );
        let (_, lasted) = until_closed(&mut idle, idle_since).await;
        assert!(
            lasted >= TIMEOUT / 2 && lasted < TIMEOUT * 8,
            "idle: {lasted:?}"
        );
        let (sent, lasted) = trickle.await.unwrap();
        assert!(lasted < TIMEOUT * 8, "trickling: {lasted:?}");
        assert!(
            !sent.contains("200"),
            "a trickled request was served: {sent}"
        );
        shutdown.cancel();
    }
}
