//! Completion tracking: per-request state shared by the slices of a request, and the batch that
//! the caller awaits or polls. Pure synchronisation (mutex, condvar, tokio `Notify`); no I/O.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::error::{Failure, TransferError};
use super::metrics::TransferMetrics;

/// Direction of a transfer request, seen from the initiator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransferOp {
    /// Remote segment -> local segment.
    Read,
    /// Local segment -> remote segment; done only once the peer applied it.
    Write,
}

impl TransferOp {
    pub fn as_str(self) -> &'static str {
        match self {
            TransferOp::Read => "read",
            TransferOp::Write => "write",
        }
    }
}

/// State of one request of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestStatus {
    Pending,
    Done,
    Failed(Failure),
}

impl RequestStatus {
    pub fn is_pending(&self) -> bool {
        matches!(self, RequestStatus::Pending)
    }
}

pub(crate) struct BatchState {
    pending: Mutex<usize>,
    cv: Condvar,
    notify: tokio::sync::Notify,
}

impl BatchState {
    fn request_finished(&self) {
        let mut p = self.pending.lock();
        *p = p.saturating_sub(1);
        if *p == 0 {
            self.cv.notify_all();
            self.notify.notify_waiters();
        }
    }
}

/// Shared by all slices of one request; the last slice to finish settles the request.
pub(crate) struct RequestState {
    batch: Arc<BatchState>,
    remaining: AtomicUsize,
    status: Mutex<RequestStatus>,
    first_failure: Mutex<Option<Failure>>,
    started: Instant,
    protocol: &'static str,
    op: &'static str,
    len: u64,
    metrics: TransferMetrics,
}

impl RequestState {
    /// Record the outcome of one slice.
    pub(crate) fn slice_done(&self, result: Result<(), Failure>) {
        if let Err(f) = result {
            let mut first = self.first_failure.lock();
            if first.is_none() {
                *first = Some(f);
            }
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let failure = self.first_failure.lock().take();
        let outcome = if failure.is_none() { "ok" } else { "failed" };
        self.metrics
            .requests
            .with_label_values(&[self.protocol, self.op, outcome])
            .inc();
        let status = match failure {
            None => {
                self.metrics
                    .bytes
                    .with_label_values(&[self.protocol, self.op])
                    .inc_by(self.len);
                self.metrics
                    .latency_for(self.protocol, self.op)
                    .observe(self.started.elapsed().as_secs_f64());
                RequestStatus::Done
            }
            Some(f) => {
                self.metrics
                    .failures
                    .with_label_values(&[self.protocol, f.category])
                    .inc();
                RequestStatus::Failed(f)
            }
        };
        *self.status.lock() = status;
        self.batch.request_finished();
    }
}

/// A submitted batch: await it, or poll each request.
pub struct Batch {
    requests: Vec<Arc<RequestState>>,
    state: Arc<BatchState>,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("requests", &self.requests.len())
            .field("pending", &*self.state.pending.lock())
            .finish()
    }
}

pub(crate) struct BatchBuilder {
    requests: Vec<Arc<RequestState>>,
    state: Arc<BatchState>,
    metrics: TransferMetrics,
}

impl BatchBuilder {
    pub(crate) fn new(count: usize, metrics: TransferMetrics) -> Self {
        BatchBuilder {
            requests: Vec::with_capacity(count),
            state: Arc::new(BatchState {
                pending: Mutex::new(count),
                cv: Condvar::new(),
                notify: tokio::sync::Notify::new(),
            }),
            metrics,
        }
    }

    /// Add a request made of `slices` slices (at least one).
    pub(crate) fn request(
        &mut self,
        protocol: &'static str,
        op: &'static str,
        len: u64,
        slices: usize,
    ) -> Arc<RequestState> {
        let r = Arc::new(RequestState {
            batch: self.state.clone(),
            remaining: AtomicUsize::new(slices.max(1)),
            status: Mutex::new(RequestStatus::Pending),
            first_failure: Mutex::new(None),
            started: Instant::now(),
            protocol,
            op,
            len,
            metrics: self.metrics.clone(),
        });
        self.requests.push(r.clone());
        r
    }

    pub(crate) fn finish(self) -> Batch {
        Batch {
            requests: self.requests,
            state: self.state,
        }
    }
}

impl Batch {
    /// Number of requests.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Current status of request `index` (`None` if out of range).
    pub fn status(&self, index: usize) -> Option<RequestStatus> {
        self.requests.get(index).map(|r| r.status.lock().clone())
    }

    /// Statuses of all requests.
    pub fn statuses(&self) -> Vec<RequestStatus> {
        self.requests
            .iter()
            .map(|r| r.status.lock().clone())
            .collect()
    }

    /// Whether every request has settled (done or failed).
    pub fn is_finished(&self) -> bool {
        *self.state.pending.lock() == 0
    }

    /// Block until every request settled or `timeout` passed; returns the statuses. Requests
    /// keep running after a timeout here: the engine's own per-connection timeout settles them.
    pub fn wait(&self, timeout: Duration) -> Result<Vec<RequestStatus>, TransferError> {
        let deadline = Instant::now() + timeout;
        let mut pending = self.state.pending.lock();
        while *pending > 0 {
            if self.state.cv.wait_until(&mut pending, deadline).timed_out() && *pending > 0 {
                return Err(TransferError::Timeout(timeout));
            }
        }
        drop(pending);
        Ok(self.statuses())
    }

    /// Like [`Batch::wait`], but succeeds only if every request is done; else the first
    /// failure (with its request index) is returned as an error string.
    pub fn wait_ok(&self, timeout: Duration) -> Result<(), BatchFailed> {
        let statuses = self.wait(timeout).map_err(|e| BatchFailed {
            index: None,
            failure: Failure::new("timeout", e.to_string()),
        })?;
        for (i, s) in statuses.into_iter().enumerate() {
            if let RequestStatus::Failed(f) = s {
                return Err(BatchFailed {
                    index: Some(i),
                    failure: f,
                });
            }
        }
        Ok(())
    }

    /// Async wait for tokio callers (the agent); same semantics as [`Batch::wait`].
    pub async fn wait_async(&self, timeout: Duration) -> Result<Vec<RequestStatus>, TransferError> {
        let fut = async {
            loop {
                let notified = self.state.notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.is_finished() {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| TransferError::Timeout(timeout))?;
        Ok(self.statuses())
    }
}

/// A batch in which some request failed (or which timed out: `index` is `None`).
#[derive(Debug, Clone, thiserror::Error)]
#[error("transfer request {index:?} failed: {failure}")]
pub struct BatchFailed {
    pub index: Option<usize>,
    pub failure: Failure,
}

impl BatchFailed {
    pub fn category(&self) -> &'static str {
        self.failure.category
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_settles_after_its_last_slice_and_keeps_the_first_failure() {
        let m = TransferMetrics::unregistered().unwrap();
        let mut b = BatchBuilder::new(2, m.clone());
        let r0 = b.request("tcp", "write", 10, 3);
        let r1 = b.request("tcp", "read", 5, 1);
        let batch = b.finish();
        r0.slice_done(Ok(()));
        r0.slice_done(Err(Failure::new("timeout", "first")));
        assert_eq!(batch.status(0), Some(RequestStatus::Pending));
        r0.slice_done(Err(Failure::new("io", "second")));
        assert!(matches!(batch.status(0), Some(RequestStatus::Failed(f)) if f.reason == "first"));
        assert!(!batch.is_finished());
        assert!(matches!(
            batch.wait(Duration::from_millis(1)),
            Err(TransferError::Timeout(_))
        ));
        r1.slice_done(Ok(()));
        assert!(batch.is_finished());
        let st = batch.wait(Duration::from_secs(1)).unwrap();
        assert_eq!(st[1], RequestStatus::Done);
        assert_eq!(batch.wait_ok(Duration::ZERO).unwrap_err().index, Some(0));
        assert_eq!(m.bytes.with_label_values(&["tcp", "read"]).get(), 5);
        assert_eq!(m.failures.with_label_values(&["tcp", "timeout"]).get(), 1);
        let requests =
            |op: &str, result: &str| m.requests.with_label_values(&["tcp", op, result]).get();
        assert_eq!((requests("read", "ok"), requests("read", "failed")), (1, 0));
        assert_eq!(
            (requests("write", "ok"), requests("write", "failed")),
            (0, 1)
        );
    }

    #[tokio::test]
    async fn async_wait_wakes_on_completion() {
        let mut b = BatchBuilder::new(1, TransferMetrics::unregistered().unwrap());
        let r = b.request("shm", "read", 1, 1);
        let batch = b.finish();
        let t = std::thread::spawn(move || r.slice_done(Ok(())));
        let st = batch.wait_async(Duration::from_secs(30)).await.unwrap();
        assert_eq!(st, vec![RequestStatus::Done]);
        t.join().unwrap();
    }
}
