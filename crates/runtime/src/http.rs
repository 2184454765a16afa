//! Serving an HTTP router until shutdown: the one serve loop of the API servers (conductor,
//! synthetic engine) and of the admin servers, with the limits that keep slow or silent clients
//! from holding it (issues 15 and 38): a cap on open connections in total and per source
//! address, where a new connection at a cap evicts the oldest connection that has not shown it
//! is a real client (`evict`); a deadline for a request's head; a deadline for a request's
//! body, which must also never stall for longer than a head may take; and an idle timeout
//! between requests. I/O boundary: the bound TCP listener and its accepted connections; what is
//! served is the caller's router.

use crate::telemetry::chain;

mod activity;
mod evict;

use activity::{Activity, Tracked, Watched, WatchedBody};
use evict::Evictable;
use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use prometheus::{IntCounterVec, IntGauge, Opts, Registry};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Limits on the connections of one HTTP server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    /// A request's head must arrive within this once its first byte did; a new connection must
    /// deliver its first request's head within this of being accepted.
    pub header_read_timeout: Duration,
    /// A request's body must arrive whole within this of its head, and no gap between its
    /// bytes may last `header_read_timeout`.
    pub body_read_timeout: Duration,
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
            body_read_timeout: Duration::from_secs(15),
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
    /// A request's body must arrive whole within this of its head (and no gap between its
    /// bytes may last --http-header-read-timeout).
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration, env = "KVPOOL_HTTP_BODY_READ_TIMEOUT")]
    pub http_body_read_timeout: Duration,
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
        if self.http_body_read_timeout.is_zero() {
            return Err(("http-body-read-timeout", ZERO));
        }
        if self.http_max_connections == 0 {
            return Err(("http-max-connections", ZERO));
        }
        if self.http_max_connections_per_source == 0 {
            return Err(("http-max-connections-per-source", ZERO));
        }
        Ok(HttpLimits {
            header_read_timeout: self.http_header_read_timeout,
            body_read_timeout: self.http_body_read_timeout,
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
    /// `header_timeout`, `body_timeout`, `idle`, or `evicted` (an unproven connection closed
    /// to make room for a new one at a cap).
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
                    "HTTP connections the server closed: a slow request head or body, idleness, or evicted to make room at a cap.",
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
    let evictable = Arc::new(Evictable::default());
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
            // At a cap: make room by closing the oldest unproven connection (of this source
            // when it is the source's cap), or refuse when every one has proven itself.
            Err(reason) => {
                let from = (reason == "per_source").then_some(peer.ip());
                if evictable.evict_oldest(from) {
                    stats.closed.with_label_values(&["evicted"]).inc();
                    // The evicted one frees its place as it ends, a moment later.
                    admission.admit_over(peer.ip())
                } else {
                    stats.refused.with_label_values(&[reason]).inc();
                    tracing::debug!(%peer, reason, "refusing an HTTP connection");
                    drop(stream);
                    continue;
                }
            }
        };
        let _ = stream.set_nodelay(true);
        let activity = Arc::new(Activity::new());
        let evict = CancellationToken::new();
        let id = evictable.add(peer.ip(), activity.clone(), evict.clone());
        let conn = Conn {
            stream,
            activity,
            evict,
        };
        let evictable = evictable.clone();
        let (router, shutdown, stats) = (router.clone(), shutdown.clone(), stats.clone());
        tasks.spawn(async move {
            serve_conn(conn, router, shutdown, limits, stats, slot).await;
            evictable.remove(id);
        });
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

    /// A place for a connection from `source` past the caps (one that evicted another, which
    /// gives its place back as it ends).
    pub fn admit_over(self: &Arc<Self>, source: IpAddr) -> ConnectionSlot {
        let mut guard = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let (total, by_source) = &mut *guard;
        *by_source.entry(source).or_default() += 1;
        *total += 1;
        ConnectionSlot {
            admission: self.clone(),
            source,
        }
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

/// How often a connection's watchdog looks at it: a fraction of the shorter timeout, within
/// [10 ms, 1 s].
fn check_every(limits: &HttpLimits) -> Duration {
    (limits.header_read_timeout.min(limits.idle_timeout) / 8)
        .clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// An accepted connection: its stream, what it is doing, and the token that evicts it.
struct Conn {
    stream: TcpStream,
    activity: Arc<Activity>,
    evict: CancellationToken,
}

async fn serve_conn(
    conn: Conn,
    router: Router,
    shutdown: CancellationToken,
    limits: HttpLimits,
    stats: HttpStats,
    slot: ConnectionSlot,
) {
    stats.open.inc();
    let Conn {
        stream,
        activity,
        evict,
    } = conn;
    let io = TokioIo::new(Watched {
        stream,
        activity: activity.clone(),
    });
    let inner = TowerToHyperService::new(router);
    let tracker = activity.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let in_flight = tracker.begin();
        let watched = req.map(|b| Body::new(WatchedBody::new(b, &tracker)));
        let call = hyper::service::Service::call(&inner, watched);
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
            // Counted as `evicted` by the accept loop.
            () = evict.cancelled() => break,
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
            body_read_timeout: Duration::from_secs(15),
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
            http_body_read_timeout: Duration::from_secs(3),
            http_idle_timeout: Duration::from_secs(2),
            http_max_connections: 3,
            http_max_connections_per_source: 2,
        };
        assert_eq!(
            args.limits(),
            Ok(HttpLimits {
                header_read_timeout: Duration::from_secs(1),
                body_read_timeout: Duration::from_secs(3),
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
