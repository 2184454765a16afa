//! Prometheus metrics of the controllers: reconciles by kind and result, reconcile duration,
//! failures by error category. Registered into an injected [`Registry`] (no global registry).
//! I/O boundary: none; the admin server exposes the registry.

use std::time::Instant;

use prometheus::{
    HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

/// Metric handles shared by every controller.
#[derive(Clone, derive_more::Debug)]
#[debug("Metrics {{ .. }}")]
pub struct Metrics {
    reconciles: IntCounterVec,
    failures: IntCounterVec,
    duration: HistogramVec,
    leader: IntGauge,
    transport_degraded: IntGaugeVec,
    /// Agent credential requests by outcome (`issued` or the refusal's reason).
    pub agent_credentials: IntCounterVec,
}

impl Metrics {
    /// Create the metrics and register them into `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let reconciles = IntCounterVec::new(
            Opts::new(
                "kvpool_operator_reconciles_total",
                "Reconciles finished, by resource kind and result (ok, invalid, error)",
            ),
            &["kind", "result"],
        )?;
        let failures = IntCounterVec::new(
            Opts::new(
                "kvpool_operator_reconcile_errors_total",
                "Failed reconciles, by resource kind and error category",
            ),
            &["kind", "category"],
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "kvpool_operator_reconcile_duration_seconds",
                "Time one reconcile took, by resource kind",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
            &["kind"],
        )?;
        let leader = IntGauge::new(
            "kvpool_operator_leader",
            "Whether this replica runs the controllers: 1 while it holds the leader lease (always 1 without leader election), else 0",
        )?;
        registry.register(Box::new(reconciles.clone()))?;
        registry.register(Box::new(failures.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        let transport_degraded = IntGaugeVec::new(
            Opts::new(
                "kvpool_operator_transport_degraded_nodes",
                "Nodes of a KVCachePool that asked for RDMA whose transfer engine fell back to TCP (the TransportDegraded condition), as of the last pass that reached the pool's master",
            ),
            &["pool_namespace", "pool"],
        )?;
        let agent_credentials = IntCounterVec::new(
            Opts::new(
                "kvpool_operator_agent_credentials_total",
                "Agent credential requests to the issuer, by outcome: issued, or the refusal's reason (token_rejected, not_an_agent, api_unavailable, ...)",
            ),
            &["outcome"],
        )?;
        registry.register(Box::new(agent_credentials.clone()))?;
        registry.register(Box::new(leader.clone()))?;
        registry.register(Box::new(transport_degraded.clone()))?;
        Ok(Self {
            reconciles,
            failures,
            duration,
            leader,
            transport_degraded,
            agent_credentials,
        })
    }

    /// Start timing one reconcile of `kind`; the duration is observed when the guard drops.
    pub fn start(&self, kind: &'static str) -> ReconcileTimer {
        ReconcileTimer {
            histogram: self.duration.with_label_values(&[kind]),
            started: Instant::now(),
        }
    }

    /// Count a finished reconcile with its result (`ok`, `invalid` or `error`).
    pub fn finished(&self, kind: &'static str, result: &'static str) {
        self.reconciles.with_label_values(&[kind, result]).inc();
    }

    /// Count a failed reconcile by error category.
    pub fn failed(&self, kind: &'static str, category: &'static str) {
        self.failures.with_label_values(&[kind, category]).inc();
    }

    /// Record whether this replica leads.
    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }

    /// Nodes of pool `namespace/pool` that fell back from RDMA to TCP.
    pub fn set_transport_degraded(&self, namespace: &str, pool: &str, nodes: usize) {
        self.transport_degraded
            .with_label_values(&[namespace, pool])
            .set(i64::try_from(nodes).unwrap_or(i64::MAX));
    }

    /// The value last set for pool `namespace/pool` (tests).
    pub fn transport_degraded(&self, namespace: &str, pool: &str) -> i64 {
        self.transport_degraded
            .with_label_values(&[namespace, pool])
            .get()
    }

    /// Reconciles counted so far for `kind` and `result` (tests and diagnostics).
    pub fn reconciles(&self, kind: &str, result: &str) -> u64 {
        self.reconciles.with_label_values(&[kind, result]).get()
    }

    /// Failures counted so far for `kind` and `category` (tests and diagnostics).
    pub fn failures(&self, kind: &str, category: &str) -> u64 {
        self.failures.with_label_values(&[kind, category]).get()
    }
}

/// Observes the elapsed time into the duration histogram when dropped.
pub struct ReconcileTimer {
    histogram: prometheus::Histogram,
    started: Instant,
}

impl Drop for ReconcileTimer {
    fn drop(&mut self) {
        self.histogram.observe(self.started.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_times_reconciles() {
        let registry = Registry::new();
        let metrics = Metrics::register(&registry).expect("register");
        {
            let _timer = metrics.start("KVCachePool");
            metrics.finished("KVCachePool", "ok");
        }
        metrics.failed("KVCachePool", "apply");
        assert_eq!(metrics.reconciles("KVCachePool", "ok"), 1);
        assert_eq!(metrics.failures("KVCachePool", "apply"), 1);
        let names: Vec<String> = registry
            .gather()
            .iter()
            .map(|m| m.name().to_owned())
            .collect();
        assert!(names.contains(&"kvpool_operator_reconcile_duration_seconds".to_owned()));
        assert!(
            Metrics::register(&registry).is_err(),
            "double registration must fail"
        );
    }
}
