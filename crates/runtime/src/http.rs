//! Serving an HTTP router until shutdown: the one serve loop of the API servers (conductor,
//! synthetic engine) and of the admin servers, with the limits that keep slow or silent clients
//! from holding it (issue 15): a cap on open connections in total and per source address, a
//! deadline for a request's head, and an idle timeout between requests. I/O boundary: the bound
//! TCP listener and its accepted connections; what is served is the caller's router.

use crate::telemetry::chain;
use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes, HttpBody};
use axum::http::{Request, Response};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use prometheus::{IntCounterVec, IntGauge, Opts, Registry};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Limits on the connections of one HTTP server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    /// A request's head must arrive within this once its first byte did; a new connection must
    /// deliver its first request's head within this of being accepted.
    pub header_read_timeout: Duration,
    /// A connection with no request in flight and no bytes coming is closed after this.
    pub idle_timeout: Duration,
    /// Connections open at once; more are accepted and closed at once.
    pub max_connections: usize,
    /// Connections open at once from one source address; more are accepted and closed at once.
    pub max_connections_per_source: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_connections: 4096,
            max_connections_per_source: 1024,
        }
    }
}

/// The command-line flags of [`HttpLimits`] (flattened into each HTTP service's flags).
#[derive(Debug, Clone, clap::Args)]
pub struct HttpLimitArgs {
    /// A request's head must arrive within this once it started (and a new connection's first
    /// head within this of connecting).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration, env = "KVPOOL_HTTP_HEADER_READ_TIMEOUT")]
    pub http_header_read_timeout: Duration,
    /// A connection with no request in flight is closed after this long idle.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration, env = "KVPOOL_HTTP_IDLE_TIMEOUT")]
    pub http_idle_timeout: Duration,
    /// Connections served at once by each HTTP server of the process (API and admin).
    #[arg(long, default_value_t = 4096, env = "KVPOOL_HTTP_MAX_CONNECTIONS")]
    pub http_max_connections: usize,
    /// Connections served at once from one source address.
    #[arg(
        long,
        default_value_t = 1024,
        env = "KVPOOL_HTTP_MAX_CONNECTIONS_PER_SOURCE"
    )]
    pub http_max_connections_per_source: usize,
}

impl HttpLimitArgs {
    /// The limits, or the flag that is out of range (its long name without the dashes) and
    /// what is wrong with it.
    pub fn limits(&self) -> Result<HttpLimits, (&'static str, &'static str)> {
        const ZERO: &str = "must be > 0";
        if self.http_header_read_timeout.is_zero() {
            return Err(("http-header-read-timeout", ZERO));
        }
        if self.http_idle_timeout.is_zero() {
            return Err(("http-idle-timeout", ZERO));
        }
        if self.http_max_connections == 0 {
            return Err(("http-max-connections", ZERO));
        }
        if self.http_max_connections_per_source == 0 {
            return Err(("http-max-connections-per-source", ZERO));
        }
        Ok(HttpLimits {
            header_read_timeout: self.http_header_read_timeout,
            idle_timeout: self.http_idle_timeout,
            max_connections: self.http_max_connections,
            max_connections_per_source: self.http_max_connections_per_source,
        })
    }
}

/// Connection metrics of one HTTP server, labelled `server` (`api`, `admin`). Cloning shares
/// the series.
#[derive(Clone, Debug)]
pub struct HttpStats {
    /// `kvpool_http_open_connections{server}`
    pub open: IntGauge,
    /// `kvpool_http_connections_refused_total{server, reason}`: `max_connections`, `per_source`.
    pub refused: IntCounterVec,
    /// `kvpool_http_connections_closed_total{server, reason}`: closed by the server for
    /// `header_timeout` or `idle`.
    pub closed: IntCounterVec,
}

impl HttpStats {
    /// The metrics of server `server`, not registered.
    pub fn new(server: &str) -> Result<Self, prometheus::Error> {
        Ok(HttpStats {
            open: IntGauge::with_opts(
                Opts::new(
                    "kvpool_http_open_connections",
                    "Open connections of an HTTP server.",
                )
                .const_label("server", server),
            )?,
            refused: IntCounterVec::new(
                Opts::new(
                    "kvpool_http_connections_refused_total",
                    "HTTP connections closed as soon as accepted, by the cap they hit.",
                )
                .const_label("server", server),
                &["reason"],
            )?,
            closed: IntCounterVec::new(
                Opts::new(
                    "kvpool_http_connections_closed_total",
                    "HTTP connections the server closed for a slow request head or idleness.",
                )
                .const_label("server", server),
                &["reason"],
            )?,
        })
    }

    /// Register the metrics into `registry`.
    pub fn register(&self, registry: &Registry) -> Result<(), prometheus::Error> {
        registry.register(Box::new(self.open.clone()))?;
        registry.register(Box::new(self.refused.clone()))?;
        registry.register(Box::new(self.closed.clone()))
    }

    /// Unregistered metrics that cannot fail to build (their options are constant).
    fn fallback() -> Self {
        Self::new("unnamed").expect("constant metric options are valid")
    }
}

/// Serves `router` on `listener` with the default [`HttpLimits`] until `shutdown` is
/// cancelled, then lets the requests in flight finish. The error is the listener's; callers
/// wrap it in their own error type.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
) -> io::Result<()> {
    serve_with(
        listener,
        router,
        shutdown,
        HttpLimits::default(),
        HttpStats::fallback(),
    )
    .await
}

/// Serves `router` on `listener` under `limits` until `shutdown` is cancelled, counting into
/// `stats`; then stops accepting, closes idle connections and waits for the requests in flight.
pub async fn serve_with(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
    limits: HttpLimits,
    stats: HttpStats,
) -> io::Result<()> {
    let admission = Arc::new(ConnectionCaps::default());
    let tasks = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            r = listener.accept() => r,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors and the like: wait a little instead of spinning.
                tracing::warn!(error = %chain(&e), "accepting an HTTP connection failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let slot = match admission.admit(
            peer.ip(),
            limits.max_connections,
            limits.max_connections_per_source,
        ) {
            Ok(slot) => slot,
            Err(reason) => {
                stats.refused.with_label_values(&[reason]).inc();
                tracing::debug!(%peer, reason, "refusing an HTTP connection");
                drop(stream);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        tasks.spawn(serve_conn(
            stream,
            router.clone(),
            shutdown.clone(),
            limits,
            stats.clone(),
            slot,
        ));
    }
    tasks.close();
    tasks.wait().await;
    Ok(())
}

/// Open connections of one server, in total and by source address (also used by the master's
/// listener).
#[derive(Debug, Default)]
pub struct ConnectionCaps {
    counts: Mutex<(usize, HashMap<IpAddr, usize>)>,
}

impl ConnectionCaps {
    /// A place for a connection from `source`, or why not (`max_connections`, `per_source`):
    /// at most `max_total` open in all and `max_per_source` from one address.
    pub fn admit(
        self: &Arc<Self>,
        source: IpAddr,
        max_total: usize,
        max_per_source: usize,
    ) -> Result<ConnectionSlot, &'static str> {
        let mut guard = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let (total, by_source) = &mut *guard;
        if *total >= max_total {
            return Err("max_connections");
        }
        let n = by_source.entry(source).or_default();
        if *n >= max_per_source {
            return Err("per_source");
        }
        *n += 1;
        *total += 1;
        Ok(ConnectionSlot {
            admission: self.clone(),
            source,
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.counts.lock().unwrap_or_else(|p| p.into_inner()).0
    }
}

/// One admitted connection; dropping it frees its place.
#[derive(Debug)]
pub struct ConnectionSlot {
    admission: Arc<ConnectionCaps>,
    source: IpAddr,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut guard = self
            .admission
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let (total, by_source) = &mut *guard;
        *total = total.saturating_sub(1);
        if let Some(n) = by_source.get_mut(&self.source) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                by_source.remove(&self.source);
            }
        }
    }
}

/// Milliseconds since the connection was accepted, or `NEVER`.
const NEVER: u64 = u64::MAX;

/// What one connection is doing, for its watchdog: requests in flight, when the last one
/// ended, and when bytes of a request head started to arrive (while none was in flight).
struct Activity {
    born: Instant,
    in_flight: AtomicUsize,
    requests: AtomicU64,
    last_done_ms: AtomicU64,
    head_started_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity {
            born: Instant::now(),
            in_flight: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            last_done_ms: AtomicU64::new(0),
            head_started_ms: AtomicU64::new(NEVER),
        }
    }

    fn now_ms(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }

    fn bytes_read(&self) {
        if self.in_flight.load(Ordering::SeqCst) == 0 {
            let now = self.now_ms();
            let _ = self.head_started_ms.compare_exchange(
                NEVER,
                now,
                Ordering::SeqCst,
                Ordering::SeqCst,
            );
        }
    }

    fn begin(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.requests.fetch_add(1, Ordering::SeqCst);
        self.head_started_ms.store(NEVER, Ordering::SeqCst);
        InFlight(self.clone())
    }

    /// Why the connection should be closed at `now` (milliseconds since it was accepted), if
    /// it should.
    fn expired(&self, limits: &HttpLimits, now: u64) -> Option<&'static str> {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let header_ms = limits.header_read_timeout.as_millis() as u64;
        if self.requests.load(Ordering::SeqCst) == 0 {
            // Not one request head yet, however the bytes trickle (or not) in.
            return (now >= header_ms).then_some("header_timeout");
        }
        let started = self.head_started_ms.load(Ordering::SeqCst);
        if started != NEVER {
            return (now.saturating_sub(started) >= header_ms).then_some("header_timeout");
        }
        let idle = now.saturating_sub(self.last_done_ms.load(Ordering::SeqCst));
        (idle >= limits.idle_timeout.as_millis() as u64).then_some("idle")
    }
}

/// A request in flight; dropped when its response body is done (or dropped).
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let a = &self.0;
        a.last_done_ms.store(a.now_ms(), Ordering::SeqCst);
        a.head_started_ms.store(NEVER, Ordering::SeqCst);
        a.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that keeps its request counted as in flight until it is sent.
struct Tracked {
    inner: Body,
    _in_flight: InFlight,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A TCP stream that tells its connection's [`Activity`] when bytes arrive.
struct Watched {
    stream: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.stream).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.bytes_read();
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// How often a connection's watchdog looks at it: a fraction of the shorter timeout, within
/// [10 ms, 1 s].
fn check_every(limits: &HttpLimits) -> Duration {
    (limits.header_read_timeout.min(limits.idle_timeout) / 8)
        .clamp(Duration::from_millis(10), Duration::from_secs(1))
}

async fn serve_conn(
    stream: TcpStream,
    router: Router,
    shutdown: CancellationToken,
    limits: HttpLimits,
    stats: HttpStats,
    slot: ConnectionSlot,
) {
    stats.open.inc();
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Watched {
        stream,
        activity: activity.clone(),
    });
    let inner = TowerToHyperService::new(router);
    let tracker = activity.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let in_flight = tracker.begin();
        let call = hyper::service::Service::call(&inner, req.map(Body::new));
        async move {
            let resp: Response<Body> = call.await?;
            Ok::<_, Infallible>(resp.map(|inner| {
                Body::new(Tracked {
                    inner,
                    _in_flight: in_flight,
                })
            }))
        }
    });
    let mut builder = Builder::new(TokioExecutor::new());
    // The watchdog below applies the header deadline to both protocols.
    builder.http1().header_read_timeout(None::<Duration>);
    let conn = builder.serve_connection_with_upgrades(io, service);
    tokio::pin!(conn);
    let mut tick = tokio::time::interval(check_every(&limits));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut closing = false;
    loop {
        tokio::select! {
            served = conn.as_mut() => {
                if let Err(e) = served {
                    tracing::debug!(error = %chain(&*e), "HTTP connection ended with an error");
                }
                break;
            }
            () = shutdown.cancelled(), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            // Also while closing: a slow client must not hold up shutdown.
            _ = tick.tick() => {
                if let Some(reason) = activity.expired(&limits, activity.now_ms()) {
                    // Nothing in flight: dropping the connection loses no answer.
                    stats.closed.with_label_values(&[reason]).inc();
                    break;
                }
            }
        }
    }
    stats.open.dec();
    drop(slot);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_and_header_deadlines_follow_activity() {
        // Times in ms since the connection was accepted; the real clock stays near 0 here.
        let limits = HttpLimits {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            ..HttpLimits::default()
        };
        let a = Arc::new(Activity::new());
        assert_eq!(a.expired(&limits, 5_000), None);
        assert_eq!(a.expired(&limits, 10_000), Some("header_timeout"));
        let req = a.begin();
        assert_eq!(
            a.expired(&limits, 100_000),
            None,
            "a request in flight is never cut"
        );
        drop(req);
        assert_eq!(
            a.expired(&limits, 20_000),
            None,
            "idle, under the idle timeout"
        );
        assert_eq!(a.expired(&limits, 30_000), Some("idle"));
        // Bytes of a next head started: the header deadline counts from them.
        a.bytes_read();
        assert_eq!(a.expired(&limits, 5_000), None);
        assert_eq!(a.expired(&limits, 10_000), Some("header_timeout"));
        drop(a.begin());
        assert_eq!(a.expired(&limits, 20_000), None);
    }

    #[test]
    fn limit_flags_are_checked() {
        let mut args = HttpLimitArgs {
            http_header_read_timeout: Duration::from_secs(1),
            http_idle_timeout: Duration::from_secs(2),
            http_max_connections: 3,
            http_max_connections_per_source: 2,
        };
        assert_eq!(
            args.limits(),
            Ok(HttpLimits {
                header_read_timeout: Duration::from_secs(1),
                idle_timeout: Duration::from_secs(2),
                max_connections: 3,
                max_connections_per_source: 2,
            })
        );
        args.http_max_connections_per_source = 0;
        assert_eq!(
            args.limits().map_err(|(flag, _)| flag),
            Err("http-max-connections-per-source")
        );
    }
}
