//! The synthetic engine's Prometheus metrics: requests, tokens, the KV traffic with the node
//! agent and its failures, prefetches, hand-offs and the wait for the prefill lane, registered
//! into the injected registry. I/O boundary: none (the admin server exports the registry).

use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Registry};

use crate::agent::{AgentKvError, ReadOutcome};
use kvpool_runtime::metrics::{counter, counters, register};

#[derive(Clone)]
pub(super) struct Metrics {
    pub(super) requests: IntCounterVec,
    pub(super) prompt_tokens: IntCounter,
    pub(super) cached_tokens: IntCounter,
    pub(super) generated_tokens: IntCounter,
    pub(super) kv_read_bytes: IntCounter,
    pub(super) kv_written_bytes: IntCounter,
    pub(super) kv_block_hits: IntCounter,
    pub(super) kv_block_misses: IntCounter,
    pub(super) kv_blocks_written: IntCounter,
    pub(super) kv_verify_failures: IntCounter,
    pub(super) kv_errors: IntCounterVec,
    pub(super) prefetches: IntCounterVec,
    pub(super) kv_seconds: HistogramVec,
    pub(super) lane_wait_seconds: Histogram,
    pub(super) handoffs: IntCounterVec,
    pub(super) kv_event_batches: IntCounter,
}

/// Buckets of the engine's latency histograms, seconds (100 µs to 10 s).
const LATENCY_BUCKETS: &[f64] = &[
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

impl Metrics {
    pub(super) fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        Ok(Self {
            requests: counters(
                registry,
                "kvpool_engine_requests_total",
                "Requests by outcome (ok or the error category)",
                &["outcome"],
            )?,
            prompt_tokens: counter(
                registry,
                "kvpool_engine_prompt_tokens_total",
                "Prompt tokens received",
            )?,
            cached_tokens: counter(
                registry,
                "kvpool_engine_cached_prompt_tokens_total",
                "Prompt tokens found in the prefix cache",
            )?,
            generated_tokens: counter(
                registry,
                "kvpool_engine_generated_tokens_total",
                "Tokens generated",
            )?,
            kv_read_bytes: counter(
                registry,
                "kvpool_engine_kv_read_bytes_total",
                "KV bytes read from the node agent",
            )?,
            kv_written_bytes: counter(
                registry,
                "kvpool_engine_kv_written_bytes_total",
                "KV bytes written to the node agent",
            )?,
            kv_block_hits: counter(
                registry,
                "kvpool_engine_kv_block_hits_total",
                "KV blocks read from the pool and verified",
            )?,
            kv_block_misses: counter(
                registry,
                "kvpool_engine_kv_block_misses_total",
                "Full prompt blocks in neither the local cache nor the pool (computed here)",
            )?,
            kv_blocks_written: counter(
                registry,
                "kvpool_engine_kv_blocks_written_total",
                "KV blocks written to the pool",
            )?,
            kv_verify_failures: counter(
                registry,
                "kvpool_engine_kv_verify_failures_total",
                "KV blocks read back with wrong length or bytes",
            )?,
            kv_errors: counters(
                registry,
                "kvpool_engine_kv_errors_total",
                "Failed calls to the node agent by operation (the request goes on without the pool)",
                &["op"],
            )?,
            prefetches: counters(
                registry,
                "kvpool_engine_prefetch_requests_total",
                "Prefetch requests by outcome (ok, unsupported without an agent, invalid, error)",
                &["outcome"],
            )?,
            kv_seconds: register(
                registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "kvpool_engine_kv_seconds",
                        "Wall time of the engine's KV work with the node agent, by operation \
                         (exists, read, write, and handoff_wait: an SGLang decode waiting for its \
                         room)",
                    )
                    .buckets(LATENCY_BUCKETS.to_vec()),
                    &["op"],
                )?,
            )?,
            lane_wait_seconds: register(
                registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "kvpool_engine_prefill_queue_seconds",
                        "Wall time requests wait for the engine's (serialised) prefill compute",
                    )
                    .buckets(LATENCY_BUCKETS.to_vec()),
                )?,
            )?,
            handoffs: counters(
                registry,
                "kvpool_engine_kv_handoffs_total",
                "SGLang-mode decode requests by hand-off outcome (ok, timeout, agent)",
                &["outcome"],
            )?,
            kv_event_batches: counter(
                registry,
                "kvpool_engine_kv_event_batches_total",
                "KV event batches published (with --kv-events-config)",
            )?,
        })
    }

    /// Counts one request by its outcome (`ok` or an error category).
    pub(super) fn request(&self, outcome: &str) {
        self.requests.with_label_values(&[outcome]).inc();
    }

    /// Counts what a read of blocks from the agent got: bytes, verified blocks, corrupt ones.
    pub(super) fn kv_read(&self, read: &ReadOutcome) {
        self.kv_read_bytes.inc_by(read.bytes);
        self.kv_block_hits.inc_by(read.verified as u64);
        self.kv_verify_failures.inc_by(read.corrupt as u64);
    }

    /// Counts a failed call to the agent, by its category.
    pub(super) fn kv_error(&self, e: &AgentKvError) {
        self.kv_errors.with_label_values(&[e.category()]).inc();
    }
}
