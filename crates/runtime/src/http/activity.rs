//! What one HTTP connection is doing, for its watchdog ([`Activity`]): requests in flight, when
//! the last one ended, when bytes of a request head started to arrive, and the request bodies
//! still arriving (a body must arrive whole within the body deadline and never stall longer
//! than the head deadline). The stream and body wrappers that report to it. I/O boundary: the
//! connection's TCP stream (through [`Watched`]).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes, HttpBody};
use hyper::body::{Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::HttpLimits;

/// Milliseconds since the connection was accepted, or `NEVER`.
const NEVER: u64 = u64::MAX;

/// What one connection is doing, for its watchdog: requests in flight, when the last one
/// ended, when bytes of a request head started to arrive (while none was in flight), and the
/// request bodies still arriving.
pub(super) struct Activity {
    born: Instant,
    in_flight: AtomicUsize,
    requests: AtomicU64,
    /// Requests whose response was sent in full.
    completed: AtomicU64,
    last_done_ms: AtomicU64,
    head_started_ms: AtomicU64,
    /// Request bodies still arriving, when the oldest of them started, and when body bytes
    /// last arrived.
    bodies_open: AtomicUsize,
    body_started_ms: AtomicU64,
    body_progress_ms: AtomicU64,
}

impl Activity {
    pub(super) fn new() -> Self {
        Activity {
            born: Instant::now(),
            in_flight: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            last_done_ms: AtomicU64::new(0),
            head_started_ms: AtomicU64::new(NEVER),
            bodies_open: AtomicUsize::new(0),
            body_started_ms: AtomicU64::new(NEVER),
            body_progress_ms: AtomicU64::new(NEVER),
        }
    }

    /// Whether the connection has shown it is a real client: a request answered in full, or
    /// one in flight whose body has arrived whole. Only unproven connections are evicted to
    /// make room for new ones.
    pub(super) fn proven(&self) -> bool {
        self.completed.load(Ordering::SeqCst) > 0
            || (self.in_flight.load(Ordering::SeqCst) > 0
                && self.bodies_open.load(Ordering::SeqCst) == 0)
    }

    fn body_opened(&self) {
        let now = self.now_ms();
        if self.bodies_open.fetch_add(1, Ordering::SeqCst) == 0 {
            self.body_started_ms.store(now, Ordering::SeqCst);
        }
        self.body_progress_ms.store(now, Ordering::SeqCst);
    }

    fn body_progress(&self) {
        self.body_progress_ms.store(self.now_ms(), Ordering::SeqCst);
    }

    fn body_closed(&self) {
        if self.bodies_open.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.body_started_ms.store(NEVER, Ordering::SeqCst);
        }
    }

    pub(super) fn now_ms(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }

    pub(super) fn bytes_read(&self) {
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

    pub(super) fn begin(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.requests.fetch_add(1, Ordering::SeqCst);
        self.head_started_ms.store(NEVER, Ordering::SeqCst);
        InFlight(self.clone())
    }

    /// Why the connection should be closed at `now` (milliseconds since it was accepted), if
    /// it should.
    pub(super) fn expired(&self, limits: &HttpLimits, now: u64) -> Option<&'static str> {
        if self.bodies_open.load(Ordering::SeqCst) > 0 {
            // A body must arrive whole within the body deadline, and never stall for longer
            // than a head may take.
            let started = self.body_started_ms.load(Ordering::SeqCst);
            let progress = self.body_progress_ms.load(Ordering::SeqCst);
            let body_ms = limits.body_read_timeout.as_millis() as u64;
            let stall_ms = limits.header_read_timeout.as_millis() as u64;
            if started != NEVER && now.saturating_sub(started) >= body_ms {
                return Some("body_timeout");
            }
            if progress != NEVER && now.saturating_sub(progress) >= stall_ms {
                return Some("body_timeout");
            }
            return None;
        }
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
pub(super) struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let a = &self.0;
        a.completed.fetch_add(1, Ordering::SeqCst);
        a.last_done_ms.store(a.now_ms(), Ordering::SeqCst);
        a.head_started_ms.store(NEVER, Ordering::SeqCst);
        a.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that keeps its request counted as in flight until it is sent.
pub(super) struct Tracked {
    pub(super) inner: Body,
    pub(super) _in_flight: InFlight,
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

/// A request body that tells its connection's [`Activity`] while it is arriving: open from
/// the head until its end (or until the handler drops it), with each frame as progress.
pub(super) struct WatchedBody<B> {
    inner: B,
    activity: Option<Arc<Activity>>,
}

impl<B: HttpBody> WatchedBody<B> {
    pub(super) fn new(inner: B, activity: &Arc<Activity>) -> Self {
        let activity = (!inner.is_end_stream()).then(|| {
            activity.body_opened();
            activity.clone()
        });
        WatchedBody { inner, activity }
    }

    fn close(&mut self) {
        if let Some(a) = self.activity.take() {
            a.body_closed();
        }
    }
}

impl<B> Drop for WatchedBody<B> {
    fn drop(&mut self) {
        if let Some(a) = self.activity.take() {
            a.body_closed();
        }
    }
}

impl<B: HttpBody + Unpin> HttpBody for WatchedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(_))) => {
                if let Some(a) = &self.activity {
                    a.body_progress();
                }
                if self.inner.is_end_stream() {
                    self.close();
                }
            }
            Poll::Ready(_) => self.close(),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A TCP stream that tells its connection's [`Activity`] when bytes arrive.
pub(super) struct Watched {
    pub(super) stream: TcpStream,
    pub(super) activity: Arc<Activity>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_body_must_arrive_whole_in_time_and_never_stall() {
        let limits = HttpLimits {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(15),
            idle_timeout: Duration::from_secs(60),
            ..HttpLimits::default()
        };
        let a = Arc::new(Activity::new());
        let req = a.begin();
        a.body_opened();
        assert!(!a.proven(), "a head proves nothing while its body is open");
        assert_eq!(a.expired(&limits, 9_000), None);
        assert_eq!(a.expired(&limits, 10_000), Some("body_timeout"), "stalled");
        a.body_progress_ms.store(12_000, Ordering::SeqCst);
        assert_eq!(
            a.expired(&limits, 14_000),
            None,
            "trickling, under both deadlines"
        );
        a.body_progress_ms.store(14_900, Ordering::SeqCst);
        assert_eq!(
            a.expired(&limits, 15_000),
            Some("body_timeout"),
            "whole body too slow"
        );
        a.body_closed();
        assert!(a.proven(), "in flight with its body whole");
        assert_eq!(
            a.expired(&limits, 100_000),
            None,
            "a request in flight is never cut"
        );
        drop(req);
        assert!(a.proven());
    }
}
