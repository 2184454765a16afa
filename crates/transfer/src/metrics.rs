//! Prometheus metrics of the transfer engine, registered into an injected registry.
//! I/O boundary: none (the admin server exposes the registry).

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

/// The engine's metrics. Cloning shares the underlying series.
#[derive(Clone, Debug)]
pub struct TransferMetrics {
    /// `kvpool_transfer_bytes_total{protocol, op}`
    pub bytes: IntCounterVec,
    /// `kvpool_transfer_request_duration_seconds{protocol, op}`
    pub latency: HistogramVec,
    /// `kvpool_transfer_failures_total{protocol, category}`
    pub failures: IntCounterVec,
    /// `kvpool_transfer_requests_total{protocol, op, result}`: finished requests, `ok` or
    /// `failed` (the error ratio per transport; `failures` says why).
    pub requests: IntCounterVec,
    /// `kvpool_transfer_fallback_total`: RDMA wanted, TCP used.
    pub fallback: IntCounter,
    /// `kvpool_transfer_active_connections`
    pub connections: IntGauge,
    /// `kvpool_transfer_direct_connections`: inline transfers' connections, busy or idle.
    pub direct_connections: IntGauge,
    /// `kvpool_transfer_notifications_dropped_total`
    pub notifications_dropped: IntCounter,
    /// `kvpool_transfer_served_bytes_total{op}`: bytes this process served as a target.
    pub served_bytes: IntCounterVec,
    /// `kvpool_transfer_target_connections`: open target-side connections.
    pub target_connections: IntGauge,
    /// `kvpool_transfer_target_refused_total{reason}`: target-side connections closed as soon
    /// as accepted (`max_connections`, `per_source`).
    pub target_refused: IntCounterVec,
    /// `kvpool_transfer_target_closed_total{reason}`: target-side connections closed before
    /// they authenticated (`handshake_timeout`, `handshake_failed`, `handshake_aborted`,
    /// `evicted`).
    pub target_closed: IntCounterVec,
    /// `kvpool_transfer_target_handshakes`: target-side connections not yet authenticated.
    pub target_handshakes: IntGauge,
    /// `kvpool_transfer_rdma_retries_total`: RDMA slices retried on another NIC.
    pub rdma_retries: IntCounter,
    /// `kvpool_transfer_vectored_frames_total`: READV/WRITEV frames sent, and
    /// `kvpool_transfer_vectored_requests_total` the requests they carried.
    pub vectored_frames: IntCounter,
    pub vectored_requests: IntCounter,
    /// `kvpool_transfer_integrity_failures_total{side}`: connections closed because a sealed
    /// record failed its check (per-frame integrity), as `initiator` or `target`.
    pub integrity_failures: IntCounterVec,
    /// `kvpool_transfer_tls_handshake_failures_total{side, reason}`: transfer connections whose
    /// TLS was refused or failed, as `initiator` or `target` (see `tls::FailureReason`).
    pub tls_handshake_failures: IntCounterVec,
}

impl TransferMetrics {
    /// Create the metrics without registering them (tests, or callers that do not export).
    pub fn unregistered() -> Result<Self, prometheus::Error> {
        let buckets = prometheus::exponential_buckets(10e-6, 2.0, 22)?;
        Ok(TransferMetrics {
            bytes: IntCounterVec::new(
                Opts::new(
                    "kvpool_transfer_bytes_total",
                    "Bytes moved by completed transfer requests.",
                ),
                &["protocol", "op"],
            )?,
            latency: HistogramVec::new(
                HistogramOpts::new(
                    "kvpool_transfer_request_duration_seconds",
                    "Time from submit to completion of a transfer request.",
                )
                .buckets(buckets),
                &["protocol", "op"],
            )?,
            requests: IntCounterVec::new(
                Opts::new(
                    "kvpool_transfer_requests_total",
                    "Finished transfer requests by protocol, op and result (ok, failed).",
                ),
                &["protocol", "op", "result"],
            )?,
            failures: IntCounterVec::new(
                Opts::new(
                    "kvpool_transfer_failures_total",
                    "Failed transfer requests by protocol and error category.",
                ),
                &["protocol", "category"],
            )?,
            fallback: IntCounter::new(
                "kvpool_transfer_fallback_total",
                "Times a peer was reached over TCP because no RDMA path worked.",
            )?,
            connections: IntGauge::new(
                "kvpool_transfer_active_connections",
                "Open initiator-side transfer connections (lanes).",
            )?,
            direct_connections: IntGauge::new(
                "kvpool_transfer_direct_connections",
                "Open initiator-side connections of inline transfers (busy or kept idle).",
            )?,
            notifications_dropped: IntCounter::new(
                "kvpool_transfer_notifications_dropped_total",
                "Notify messages dropped because the queue was full.",
            )?,
            served_bytes: IntCounterVec::new(
                Opts::new(
                    "kvpool_transfer_served_bytes_total",
                    "Bytes read from or written into local segments by remote peers.",
                ),
                &["op"],
            )?,
            target_connections: IntGauge::new(
                "kvpool_transfer_target_connections",
                "Open target-side transfer connections.",
            )?,
            target_refused: IntCounterVec::new(
                Opts::new(
                    "kvpool_transfer_target_refused_total",
                    "Target-side connections closed as soon as accepted, by the cap they hit.",
                ),
                &["reason"],
            )?,
            target_closed: IntCounterVec::new(
                Opts::new(
                    "kvpool_transfer_target_closed_total",
                    "Target-side connections closed before they authenticated, by reason.",
                ),
                &["reason"],
            )?,
            target_handshakes: IntGauge::new(
                "kvpool_transfer_target_handshakes",
                "Target-side connections accepted and not yet through the handshake.",
            )?,
            rdma_retries: IntCounter::new(
                "kvpool_transfer_rdma_retries_total",
                "RDMA slices retried on another NIC after a failed post or completion.",
            )?,
            vectored_frames: IntCounter::new(
                "kvpool_transfer_vectored_frames_total",
                "READV/WRITEV frames sent: several small requests to one segment in one frame.",
            )?,
            vectored_requests: IntCounter::new(
                "kvpool_transfer_vectored_requests_total",
                "Requests carried by vectored frames (over vectored_frames_total: requests per frame).",
            )?,
            integrity_failures: IntCounterVec::new(
                Opts::new(
                    "kvpool_transfer_integrity_failures_total",
                    "Connections closed because a frame failed its per-frame integrity check.",
                ),
                &["side"],
            )?,
            tls_handshake_failures: IntCounterVec::new(
                Opts::new(
                    "kvpool_transfer_tls_handshake_failures_total",
                    "Transfer connections whose TLS was refused or whose TLS handshake failed, \
                     by side and reason.",
                ),
                &["side", "reason"],
            )?,
        })
    }

    /// Create the metrics and register them into `registry`.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let m = Self::unregistered()?;
        registry.register(Box::new(m.bytes.clone()))?;
        registry.register(Box::new(m.latency.clone()))?;
        registry.register(Box::new(m.failures.clone()))?;
        registry.register(Box::new(m.requests.clone()))?;
        // The data transports this build has, exported at 0 from the start so that rates and
        // error ratios per transport exist before the first transfer (or failure).
        let protocols: &[&str] = if cfg!(feature = "rdma") {
            &["tcp", "shm", "rdma"]
        } else {
            &["tcp", "shm"]
        };
        for op in ["read", "write"] {
            m.served_bytes.with_label_values(&[op]);
        }
        for protocol in protocols {
            for op in ["read", "write"] {
                m.bytes.with_label_values(&[protocol, op]);
                for result in ["ok", "failed"] {
                    m.requests.with_label_values(&[protocol, op, result]);
                }
            }
        }
        registry.register(Box::new(m.fallback.clone()))?;
        registry.register(Box::new(m.connections.clone()))?;
        registry.register(Box::new(m.direct_connections.clone()))?;
        registry.register(Box::new(m.notifications_dropped.clone()))?;
        registry.register(Box::new(m.served_bytes.clone()))?;
        registry.register(Box::new(m.target_connections.clone()))?;
        registry.register(Box::new(m.target_refused.clone()))?;
        registry.register(Box::new(m.target_closed.clone()))?;
        registry.register(Box::new(m.target_handshakes.clone()))?;
        registry.register(Box::new(m.rdma_retries.clone()))?;
        registry.register(Box::new(m.vectored_frames.clone()))?;
        registry.register(Box::new(m.vectored_requests.clone()))?;
        for side in ["initiator", "target"] {
            m.integrity_failures.with_label_values(&[side]);
        }
        registry.register(Box::new(m.integrity_failures.clone()))?;
        registry.register(Box::new(m.tls_handshake_failures.clone()))?;
        Ok(m)
    }

    pub(crate) fn latency_for(&self, protocol: &str, op: &str) -> Histogram {
        self.latency.with_label_values(&[protocol, op])
    }
}
