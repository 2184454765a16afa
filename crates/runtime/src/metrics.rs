//! Small constructors for Prometheus metrics, shared by every role: make a metric and, for the
//! `gauge`/`counter`/`counters` forms, register it into a registry in the same step. Pure: no
//! I/O (registries are in memory).

use prometheus::core::Collector;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// Register `metric` into `registry` and hand it back.
pub fn register<T: Collector + Clone + 'static>(
    registry: &Registry,
    metric: T,
) -> prometheus::Result<T> {
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

/// `metric` as just made (its constructor's result), registered into `registry`.
pub fn made<T: Collector + Clone + 'static>(
    registry: &Registry,
    metric: prometheus::Result<T>,
) -> prometheus::Result<T> {
    register(registry, metric?)
}

/// A new counter `name` with `labels`, not registered yet.
pub fn counter_vec(name: &str, help: &str, labels: &[&str]) -> prometheus::Result<IntCounterVec> {
    IntCounterVec::new(Opts::new(name, help), labels)
}

/// A new gauge `name`, registered into `registry`.
pub fn gauge(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntGauge> {
    register(registry, IntGauge::new(name, help)?)
}

/// A new counter `name`, registered into `registry`.
pub fn counter(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntCounter> {
    register(registry, IntCounter::new(name, help)?)
}

/// A new counter `name` with `labels`, registered into `registry`.
pub fn counters(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    register(registry, counter_vec(name, help, labels)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registered_metrics_are_gathered_and_a_second_name_is_refused() {
        let registry = Registry::new();
        let c = counters(&registry, "kvpool_test_total", "help", &["kind"]).unwrap();
        c.with_label_values(&["a"]).inc();
        gauge(&registry, "kvpool_test_gauge", "help")
            .unwrap()
            .set(3);
        let names: Vec<_> = registry
            .gather()
            .iter()
            .map(|f| f.name().to_owned())
            .collect();
        assert_eq!(names, ["kvpool_test_gauge", "kvpool_test_total"]);
        assert!(counter(&registry, "kvpool_test_gauge", "again").is_err());
        // `made` registers what its constructor made, and passes a constructor's error on
        // without registering anything.
        made(&registry, IntGauge::new("kvpool_test_made", "help")).unwrap();
        assert!(made(&registry, IntGauge::new("bad name", "help")).is_err());
        assert_eq!(registry.gather().len(), 3);
    }
}
