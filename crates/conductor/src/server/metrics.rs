//! The conductor's Prometheus metrics: request outcomes, rejections, replication, pool lookups,
//! prefetches, the engine set's size, the learnt pool bandwidth and prefill cost models, and the
//! per-request latencies (`latency`), registered into the injected registry. I/O boundary: none
//! (the admin server exports the registry).

use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGaugeVec, Opts,
    Registry,
};

use kvpool_runtime::metrics::{counter, counters, register};

use std::sync::Arc;

use super::latency::Latency;
use crate::config::ConductorConfig;
use crate::engines::Engines;
use crate::prefill_costs::PrefillCosts;
use kvpool_core::sched::RejectReason;

/// Every metric of one conductor.
pub(super) struct Metrics {
    pub(super) requests: IntCounterVec,
    pub(super) rejections: IntCounterVec,
    pub(super) replication_tasks: IntCounter,
    pub(super) replication_blocks: IntCounterVec,
    pub(super) engines: IntGaugeVec,
    pub(super) pool_lookups: IntCounterVec,
    pub(super) share_load: IntCounterVec,
    pub(super) hot_pool: IntCounterVec,
    pub(super) peer_conductors: prometheus::IntGauge,
    pub(super) engine_tokenize: IntCounterVec,
    pub(super) prefetches: IntCounterVec,
    pub(super) fetch_bandwidth: Gauge,
    pub(super) pool_lookup_seconds: Histogram,
    pub(super) kv_events: IntCounterVec,
    pub(super) kv_event_batches: IntCounterVec,
    pub(super) kv_event_gaps: IntCounterVec,
    pub(super) kv_event_connections: IntCounterVec,
    pub(super) engine_cached_blocks: IntGaugeVec,
    pub(super) prefill_cost: GaugeVec,
    pub(super) prefill_cost_observations: IntCounterVec,
    pub(super) prefill_cost_error: GaugeVec,
    pub(super) decode_cost: GaugeVec,
    pub(super) decode_cost_error: Gauge,
    pub(super) handoff_cost: GaugeVec,
    pub(super) handoff_cost_error: Gauge,
    pub(super) decode_tokens_observed: IntCounterVec,
    /// Time to first token, per output token, end to end, queue wait, in flight, SLO results.
    pub(super) latency: Arc<Latency>,
}

impl Metrics {
    /// Creates and registers the metrics, with the main outcomes exported at 0 from the start
    /// (the pool lookup outcomes only when `config` has a pool).
    pub(super) fn register(
        config: &ConductorConfig,
        registry: &Registry,
    ) -> Result<Self, prometheus::Error> {
        let requests = counters(
            registry,
            "kvpool_conductor_requests_total",
            "Requests by outcome (ok, rejected, or the error category)",
            &["outcome"],
        )?;
        let rejections = counters(
            registry,
            "kvpool_conductor_rejections_total",
            "Requests rejected at arrival, by reason",
            &["reason"],
        )?;
        let replication_tasks = counter(
            registry,
            "kvpool_conductor_replication_tasks_total",
            "Hot-prefix replication tasks planned (each sends prefetch requests to its targets)",
        )?;
        let replication_blocks = counters(
            registry,
            "kvpool_conductor_replication_blocks_total",
            "Blocks that hot-prefix replication tasks ask to copy, by target prefill engine URL",
            &["target"],
        )?;
        let pool_lookups = counters(
            registry,
            "kvpool_conductor_pool_lookups_total",
            "Per-request pool prefix lookups at the master, by outcome (hit, miss, error, unnamed, \
             timeout, and backoff: skipped after a failure; all but hit and miss place the \
             request on local caches only)",
            &["outcome"],
        )?;
        let share_load = counters(
            registry,
            "kvpool_conductor_share_load_total",
            "Reports of this replica's bookings to the master, answered with the other \
             replicas' (ShareLoad), by outcome (ok, error, timeout)",
            &["outcome"],
        )?;
        let hot_pool = counters(
            registry,
            "kvpool_conductor_hot_pool_replications_total",
            "Hot prefixes whose blocks the master was asked to keep more copies of \
             (ReplicateHot), by outcome (ok, partial: some blocks were not in the pool, error, \
             timeout; busy and unnamed were not sent)",
            &["outcome"],
        )?;
        let peer_conductors = kvpool_runtime::metrics::made(
            registry,
            prometheus::IntGauge::new(
                "kvpool_conductor_peer_conductors",
                "Other conductor replicas whose bookings this one counts, as of the master's \
                 last answer",
            ),
        )?;
        let engine_tokenize = counters(
            registry,
            "kvpool_conductor_engine_tokenize_total",
            "Prompts tokenised by a prefill engine's /tokenize (--tokenizer engine), by outcome \
             (ok; refused, error and timeout fall back to stand-in chunks)",
            &["outcome"],
        )?;
        let prefetches = counters(
            registry,
            "kvpool_conductor_prefetches_total",
            "Prefetch requests of hot-prefix replication by outcome (ok, unsupported, error, \
             timeout; busy and skipped_unsupported were not sent)",
            &["outcome"],
        )?;
        let engines = register(
            registry,
            IntGaugeVec::new(
                Opts::new(
                    "kvpool_conductor_engines",
                    "Engine instances the conductor routes to, by role",
                ),
                &["role"],
            )?,
        )?;
        let fetch_bandwidth = register(
            registry,
            Gauge::new(
                "kvpool_conductor_pool_fetch_bandwidth_bytes_per_second",
                "Pool -> prefill bandwidth the TTFT estimate assumes (cost-model seconds): the \
                 configured figure until the engines report measured reads, then their moving \
                 average",
            )?,
        )?;
        let pool_lookup_seconds = register(
            registry,
            Histogram::with_opts(
                HistogramOpts::new(
                    "kvpool_conductor_pool_lookup_seconds",
                    "Wall time of the per-request pool prefix lookups at the master",
                )
                .buckets(vec![
                    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                ]),
            )?,
        )?;
        let kv_events = counters(
            registry,
            "kvpool_conductor_kv_events_total",
            "Block events applied from the prefill engines' KV event streams, by kind \
             (stored and removed count blocks, cleared counts AllBlocksCleared events)",
            &["kind"],
        )?;
        let kv_event_batches = counters(
            registry,
            "kvpool_conductor_kv_event_batches_total",
            "KV event batches received, by result (applied, bad_frames, bad_payload)",
            &["result"],
        )?;
        let kv_event_gaps = counters(
            registry,
            "kvpool_conductor_kv_event_gaps_total",
            "Breaks in an engine's KV event sequence, by recovery (replayed: the missed \
             batches came back from the replay socket; cleared: the engine's entries were \
             dropped; restart: the sequence started again)",
            &["recovery"],
        )?;
        let kv_event_connections = counters(
            registry,
            "kvpool_conductor_kv_event_connections_total",
            "KV event subscriptions, by outcome (connected, error)",
            &["outcome"],
        )?;
        let engine_cached_blocks = register(
            registry,
            IntGaugeVec::new(
                Opts::new(
                    "kvpool_conductor_engine_cached_blocks",
                    "Blocks the conductor believes a prefill engine holds, by engine URL and \
                     source (events: the engine's own KV events; mirror: guessed from routing \
                     decisions, the fallback for engines without an event stream)",
                ),
                &["engine", "source"],
            )?,
        )?;
        let prefill_cost = register(
            registry,
            GaugeVec::new(
                Opts::new(
                    "kvpool_conductor_prefill_cost_seconds",
                    "Prefill cost model per prefill engine URL, by term (fixed: seconds per \
                     request, linear: per uncached token, quadratic: per squared token; \
                     cost-model seconds) and source (prior: --prefill-cost; fitted: from the \
                     engine's measured prefills; pooled: from those of every engine serving its \
                     model, until its own fit is ready; in use once present)",
                ),
                &["engine", "term", "source"],
            )?,
        )?;
        let prefill_cost_observations = counters(
            registry,
            "kvpool_conductor_prefill_cost_observations_total",
            "Measured prefills fed to the fit of a prefill engine's cost model, by engine URL \
             (outliers and requests that queued behind others excluded)",
            &["engine"],
        )?;
        let prefill_cost_error = register(
            registry,
            GaugeVec::new(
                Opts::new(
                    "kvpool_conductor_prefill_cost_error_ratio",
                    "Relative error of a prefill engine's fitted cost model, by engine URL: the \
                     moving mean (about the last 20) of abs(predicted - measured) / measured over \
                     the measured prefills, each predicted by the fit in use before it came",
                ),
                &["engine"],
            )?,
        )?;
        let decode_cost = register(
            registry,
            GaugeVec::new(
                Opts::new(
                    "kvpool_conductor_decode_cost_seconds",
                    "Decode step cost model, by term (fixed: seconds per step, per_seq: per \
                     running sequence, per_ctx_token: per context token in the batch; \
                     cost-model seconds) and source (prior: the configured model; fitted: the \
                     prior scaled to the observed times per output token, in use once present)",
                ),
                &["term", "source"],
            )?,
        )?;
        let decode_cost_error = register(
            registry,
            Gauge::new(
                "kvpool_conductor_decode_cost_error_ratio",
                "Relative error of the predicted time per output token: the moving mean (about \
                 the last 20) of abs(predicted - observed) / observed over served requests, \
                 each predicted at its placement",
            )?,
        )?;
        let handoff_cost = register(
            registry,
            GaugeVec::new(
                Opts::new(
                    "kvpool_conductor_handoff_cost_seconds",
                    "Hand-off model: the time from a prefill engine's answer to the decode \
                     engine's first token, by term (fixed: seconds per request, per_token: per \
                     prompt token; cost-model seconds) and source (prior: the configured model; \
                     fitted: the least-squares line of the measured hand-offs, in use once \
                     present); part of every TTFT estimate",
                ),
                &["term", "source"],
            )?,
        )?;
        let handoff_cost_error = register(
            registry,
            Gauge::new(
                "kvpool_conductor_handoff_cost_error_ratio",
                "Relative error of the predicted hand-off: the moving mean (about the last 20) \
                 of abs(predicted - measured) / measured, each predicted by the fit in use \
                 before the measurement",
            )?,
        )?;
        let decode_tokens_observed = counters(
            registry,
            "kvpool_conductor_decode_tokens_observed_total",
            "Tokens counted in the decode engines' responses as they pass (SSE events with a \
             choice; usage.completion_tokens of whole responses), by decode engine URL",
            &["engine"],
        )?;
        // Fixed for the process: set once, not kept.
        let kv_bytes_per_token = register(
            registry,
            prometheus::IntGauge::new(
                "kvpool_conductor_kv_bytes_per_token",
                "KV bytes one token takes in one engine rank's cache, as the TTFT estimate's \
                 transfer terms count them (--kv-bytes-per-token, else the model directory's \
                 config.json, else the 70B-class default)",
            )?,
        )?;
        kv_bytes_per_token.set(i64::try_from(config.scheduler.bytes_per_token).unwrap_or(i64::MAX));
        let latency = Arc::new(Latency::register(
            registry,
            config.scheduler.slo,
            config.time_scale,
        )?);
        // Export the main outcomes at 0 from the start, so rate() and alert rules see the series
        // before the first request instead of an absent one.
        for outcome in ["ok", "rejected"] {
            requests.with_label_values(&[outcome]);
        }
        for reason in [
            RejectReason::Ttft { estimate_s: 0.0 },
            RejectReason::Tpot { estimate_s: 0.0 },
            RejectReason::DecodeMemory,
            RejectReason::NoInstance,
        ] {
            rejections.with_label_values(&[reason.category()]);
        }
        if !config.kv_events.is_empty() {
            for kind in ["stored", "removed", "cleared"] {
                kv_events.with_label_values(&[kind]);
            }
            for recovery in ["replayed", "cleared", "restart"] {
                kv_event_gaps.with_label_values(&[recovery]);
            }
        }
        if config.pool.is_some() {
            for outcome in ["hit", "miss", "error", "unnamed", "timeout", "backoff"] {
                pool_lookups.with_label_values(&[outcome]);
            }
        }
        if config.pool.as_ref().is_some_and(|p| p.hot.is_some()) {
            for outcome in ["ok", "partial", "error", "timeout"] {
                hot_pool.with_label_values(&[outcome]);
            }
        }
        if config.pool.as_ref().is_some_and(|p| p.share.is_some()) {
            for outcome in ["ok", "error", "timeout"] {
                share_load.with_label_values(&[outcome]);
            }
        }
        Ok(Self {
            requests,
            rejections,
            replication_tasks,
            replication_blocks,
            engines,
            pool_lookups,
            share_load,
            hot_pool,
            peer_conductors,
            engine_tokenize,
            prefetches,
            fetch_bandwidth,
            pool_lookup_seconds,
            kv_events,
            kv_event_batches,
            kv_event_gaps,
            kv_event_connections,
            engine_cached_blocks,
            prefill_cost,
            prefill_cost_observations,
            prefill_cost_error,
            decode_cost,
            decode_cost_error,
            handoff_cost,
            handoff_cost_error,
            decode_tokens_observed,
            latency,
        })
    }

    /// The cost gauges of `engines` follow `costs`: the prior always, the fit once there is one.
    pub(super) fn set_prefill_costs(&self, costs: &PrefillCosts, engines: &[String]) {
        for e in engines {
            let fitted = costs.is_fitted(e).then(|| costs.current(e));
            if costs.source(e) == "fitted" {
                // The group's model is no longer this engine's.
                for term in ["fixed", "linear", "quadratic"] {
                    let _ = self
                        .prefill_cost
                        .remove_label_values(&[e.as_str(), term, "pooled"]);
                }
            }
            for (source, cost) in [("prior", Some(costs.prior())), (costs.source(e), fitted)] {
                let Some(c) = cost else { continue };
                for (term, v) in [
                    ("fixed", c.fixed_s),
                    ("linear", c.linear_s),
                    ("quadratic", c.quadratic_s),
                ] {
                    self.prefill_cost
                        .with_label_values(&[e.as_str(), term, source])
                        .set(v);
                }
            }
            if let Some(err) = costs.error(e).and_then(|f| f.mean()) {
                self.prefill_cost_error
                    .with_label_values(&[e.as_str()])
                    .set(err);
            }
            if costs.fitting() {
                self.prefill_cost_observations
                    .with_label_values(&[e.as_str()]);
            }
        }
    }

    /// The decode cost gauges follow `fit`: the prior always, the fit and its error once there.
    pub(super) fn set_decode_cost(&self, fit: &crate::decode_cost::DecodeFit) {
        let fitted = fit.is_fitted().then(|| fit.current());
        for (source, cost) in [("prior", Some(fit.prior())), ("fitted", fitted)] {
            let Some(c) = cost else { continue };
            for (term, v) in [
                ("fixed", c.fixed_s),
                ("per_seq", c.per_seq_s),
                ("per_ctx_token", c.per_ctx_token_s),
            ] {
                self.decode_cost.with_label_values(&[term, source]).set(v);
            }
        }
        if let Some(e) = fit.error_ratio() {
            self.decode_cost_error.set(e);
        }
    }

    /// The hand-off gauges follow `fit`: the prior always, the fit and its error once there.
    pub(super) fn set_handoff_cost(&self, fit: &crate::handoff_fit::HandoffFit) {
        let fitted = fit.is_fitted().then(|| fit.current());
        for (source, cost) in [("prior", Some(fit.status().prior)), ("fitted", fitted)] {
            let Some(c) = cost else { continue };
            for (term, v) in [("fixed", c.fixed_s), ("per_token", c.per_token_s)] {
                self.handoff_cost.with_label_values(&[term, source]).set(v);
            }
        }
        if let Some(e) = fit.error_ratio() {
            self.handoff_cost_error.set(e);
        }
    }

    /// Counts one request by its outcome (`ok`, `rejected` or an error category).
    pub(super) fn request(&self, outcome: &str) {
        self.requests.with_label_values(&[outcome]).inc();
    }

    /// The engine gauges follow `engines`.
    pub(super) fn set_engines(&self, engines: &Engines) {
        self.engines
            .with_label_values(&["prefill"])
            .set(engines.prefill.len() as i64);
        self.engines
            .with_label_values(&["decode"])
            .set(engines.decode.len() as i64);
    }
}
