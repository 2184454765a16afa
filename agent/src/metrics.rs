//! Prometheus metrics of the agent, registered into an injected registry (the admin server's).
//! I/O boundary: none; the admin server exposes the registry.

use prometheus::{
    Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry,
};

/// Errors of metric registration.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum MetricsError {
    #[error("registering metric {name} failed")]
    Register {
        name: &'static str,
        #[source]
        source: prometheus::Error,
    },
}

kvpool_runtime::error_category!(MetricsError);

/// Every metric the agent exports.
#[derive(Clone, Debug)]
pub struct AgentMetrics {
    /// Bytes by tier (`dram`, `ssd`) and NUMA node (`all` for the SSD tier).
    pub capacity_bytes: GaugeVec,
    pub used_bytes: GaugeVec,
    pub free_bytes: GaugeVec,
    /// 1 - largest free region / free bytes, per DRAM segment's NUMA node.
    pub dram_fragmentation: GaugeVec,
    pub blocks: GaugeVec,
    /// Gets served, by tier.
    pub hits: IntCounterVec,
    pub misses: IntCounter,
    pub promotions: IntCounter,
    pub demotions: IntCounter,
    /// Blocks evicted from DRAM without an SSD copy, by reason.
    pub dropped: IntCounterVec,
    pub bytes_read: IntCounterVec,
    pub bytes_written: IntCounterVec,
    pub op_seconds: HistogramVec,
    pub ssd_corrupt: IntCounter,
    /// 1 while the SSD tier is full and demotion is stopped.
    pub ssd_full: IntGauge,
    pub discovery_warnings: IntGauge,
    /// DRAM segments announced unbound although a NUMA node was asked for them (the binding
    /// failed or the pages were read back elsewhere; see `numa_verify`).
    pub numa_binding_failures: IntCounter,
    pub sessions: IntGauge,
    pub staging_bytes: Gauge,
    pub errors: IntCounterVec,
}

/// `kvpool_runtime::metrics::made` for [`AgentMetrics`]: a failure to make or to register
/// `metric` names it.
fn reg<T: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    name: &'static str,
    metric: prometheus::Result<T>,
) -> Result<T, MetricsError> {
    kvpool_runtime::metrics::made(registry, metric)
        .map_err(|source| MetricsError::Register { name, source })
}

impl AgentMetrics {
    /// Create and register every metric.
    pub fn new(registry: &Registry) -> Result<Self, MetricsError> {
        let tier_numa = &["tier", "numa_node"];
        Ok(Self {
            capacity_bytes: reg(
                registry,
                "capacity",
                GaugeVec::new(
                    Opts::new("kvpool_agent_capacity_bytes", "Tier capacity in bytes"),
                    tier_numa,
                ),
            )?,
            used_bytes: reg(
                registry,
                "used",
                GaugeVec::new(
                    Opts::new("kvpool_agent_used_bytes", "Tier bytes in use"),
                    tier_numa,
                ),
            )?,
            free_bytes: reg(
                registry,
                "free",
                GaugeVec::new(
                    Opts::new("kvpool_agent_free_bytes", "Tier bytes free"),
                    tier_numa,
                ),
            )?,
            dram_fragmentation: reg(
                registry,
                "fragmentation",
                GaugeVec::new(
                    Opts::new(
                        "kvpool_agent_dram_fragmentation_ratio",
                        "1 - largest free region / free bytes of the DRAM tier",
                    ),
                    &["numa_node"],
                ),
            )?,
            blocks: reg(
                registry,
                "blocks",
                GaugeVec::new(Opts::new("kvpool_agent_blocks", "Blocks stored"), &["tier"]),
            )?,
            hits: reg(
                registry,
                "hits",
                IntCounterVec::new(
                    Opts::new("kvpool_agent_hits_total", "Gets served, by tier"),
                    &["tier"],
                ),
            )?,
            misses: reg(
                registry,
                "misses",
                IntCounter::new("kvpool_agent_misses_total", "Gets of absent keys"),
            )?,
            promotions: reg(
                registry,
                "promotions",
                IntCounter::new(
                    "kvpool_agent_promotions_total",
                    "Blocks copied from SSD to DRAM on a hit",
                ),
            )?,
            demotions: reg(
                registry,
                "demotions",
                IntCounter::new(
                    "kvpool_agent_demotions_total",
                    "Blocks written from DRAM to SSD on eviction",
                ),
            )?,
            dropped: reg(
                registry,
                "dropped",
                IntCounterVec::new(
                    Opts::new(
                        "kvpool_agent_evicted_dropped_total",
                        "Blocks evicted from DRAM without an SSD copy, by reason",
                    ),
                    &["reason"],
                ),
            )?,
            bytes_read: reg(
                registry,
                "bytes_read",
                IntCounterVec::new(
                    Opts::new("kvpool_agent_read_bytes_total", "Bytes read, by tier"),
                    &["tier"],
                ),
            )?,
            bytes_written: reg(
                registry,
                "bytes_written",
                IntCounterVec::new(
                    Opts::new("kvpool_agent_written_bytes_total", "Bytes written, by tier"),
                    &["tier"],
                ),
            )?,
            op_seconds: reg(
                registry,
                "op_seconds",
                HistogramVec::new(
                    HistogramOpts::new(
                        "kvpool_agent_op_duration_seconds",
                        "Engine API operation latency",
                    )
                    .buckets(prometheus::exponential_buckets(5e-6, 2.0, 20).unwrap_or_default()),
                    &["op"],
                ),
            )?,
            ssd_corrupt: reg(
                registry,
                "ssd_corrupt",
                IntCounter::new(
                    "kvpool_agent_ssd_corrupt_blocks_total",
                    "SSD blocks dropped because they were truncated or failed their checksum",
                ),
            )?,
            ssd_full: reg(
                registry,
                "ssd_full",
                IntGauge::new(
                    "kvpool_agent_ssd_full",
                    "1 while the SSD tier is full and demotion is stopped",
                ),
            )?,
            discovery_warnings: reg(
                registry,
                "discovery_warnings",
                IntGauge::new(
                    "kvpool_agent_discovery_warnings",
                    "Entries topology discovery could not read or understand",
                ),
            )?,
            numa_binding_failures: reg(
                registry,
                "numa_binding_failures",
                IntCounter::new(
                    "kvpool_agent_numa_binding_failures_total",
                    "DRAM segments announced unbound because their NUMA binding failed or was not verified",
                ),
            )?,
            sessions: reg(
                registry,
                "sessions",
                IntGauge::new("kvpool_agent_api_sessions", "Open engine API sessions"),
            )?,
            staging_bytes: reg(
                registry,
                "staging_bytes",
                Gauge::new(
                    "kvpool_agent_api_staging_bytes",
                    "Shared-memory staging bytes of open sessions",
                ),
            )?,
            errors: reg(
                registry,
                "errors",
                IntCounterVec::new(
                    Opts::new("kvpool_agent_errors_total", "Errors by category"),
                    &["category"],
                ),
            )?,
        })
    }
}
