//! Prometheus metrics of the master, registered into an injected registry. State figures
//! (objects, bytes per tier and per node, leases...) are refreshed from
//! [`kvpool_core::master::state::Stats`], [`NodeUsage`] and [`NodeReport`] (the per-node `get`
//! hits) by the tick loop; request counts,
//! latencies and lookup hits and misses are recorded per call. I/O boundary: none.

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

use std::collections::{BTreeMap, BTreeSet};

use kvpool_core::master::state::{Counters, NodeReport, NodeUsage, Stats};
use kvpool_core::master::types::Tier;

/// Errors of metric registration.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum MetricsError {
    #[error("cannot register master metrics")]
    Register(#[source] prometheus::Error),
}

kvpool_runtime::error_category!(MetricsError);

/// `metric`, made, registered into `registry` (a failure of either is [`MetricsError`]).
fn reg<T: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    metric: prometheus::Result<T>,
) -> Result<T, MetricsError> {
    kvpool_runtime::metrics::made(registry, metric).map_err(MetricsError::Register)
}

/// The client calls whose keys count as lookups (hit ratio).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LookupCall {
    Get = 0,
    Exists = 1,
    LongestPrefix = 2,
}

/// The master's metric handles.
#[derive(Clone, Debug)]
pub struct MasterMetrics {
    objects: IntGauge,
    pending_puts: IntGauge,
    used_bytes: IntGaugeVec,
    capacity_bytes: IntGaugeVec,
    leases: IntGauge,
    under_replicated: IntGauge,
    tasks: IntGauge,
    nodes_alive: IntGauge,
    leader: IntGauge,
    evictions: IntCounterVec,
    events: IntCounterVec,
    requests: IntCounterVec,
    latency: HistogramVec,
    persist_latency: Histogram,
    /// How long read leases held their objects, by how they ended: `[released, expired]`.
    lease_holds: [Histogram; 2],
    fast_connections: IntGauge,
    fast_refusals: IntCounterVec,
    conn_refusals: IntCounterVec,
    kv_event_batches: IntCounter,
    kv_events: IntCounterVec,
    kv_event_resyncs: IntCounter,
    soft_pins: IntGauge,
    segments: IntGauge,
    node_used: IntGaugeVec,
    node_capacity: IntGaugeVec,
    /// The `(node, tier)` series of the per-node gauges set by the last refresh.
    node_series: std::sync::Arc<parking_lot::Mutex<BTreeSet<(String, &'static str)>>>,
    /// Keys looked up, per call (`get`, `exists`, `longest_prefix`): `[hit, miss]`.
    lookups: [[IntCounter; 2]; 3],
    node_get_hits: IntCounterVec,
    /// The core's `get` hit count behind each `(node, tier)` series, as of the last refresh.
    node_hit_series: std::sync::Arc<parking_lot::Mutex<BTreeMap<(String, &'static str), u64>>>,
    policy: &'static str,
    last: std::sync::Arc<parking_lot::Mutex<Counters>>,
}

impl MasterMetrics {
    pub fn new(registry: &Registry, policy: &'static str) -> Result<Self, MetricsError> {
        // Each metric is registered as it is made.
        let g = |name: &str, help: &str| reg(registry, IntGauge::new(name, help));
        let per_tier = |name: &str, help: &str| {
            reg(registry, IntGaugeVec::new(Opts::new(name, help), &["tier"]))
        };
        let counters = |name: &str, help: &str, labels: &[&str]| {
            reg(
                registry,
                kvpool_runtime::metrics::counter_vec(name, help, labels),
            )
        };
        let per_node = |name: &str, help: &str| {
            reg(
                registry,
                IntGaugeVec::new(Opts::new(name, help), &["node", "tier"]),
            )
        };
        let lookups = counters(
            "kvpool_master_lookup_keys_total",
            "Keys looked up by clients, by call (get, exists, longest_prefix) and result (hit: \
             committed and readable; miss: not, or after the first missing key of a prefix)",
            &["call", "result"],
        )?;
        let lookup = |call: &str| {
            [
                lookups.with_label_values(&[call, "hit"]),
                lookups.with_label_values(&[call, "miss"]),
            ]
        };
        let lease_holds = reg(
            registry,
            HistogramVec::new(
                HistogramOpts::new(
                    "kvpool_master_lease_hold_seconds",
                    "How long a read lease held its object in place (the wait a remove or an \
                 eviction of the object faces), by how the lease ended: released by its \
                 reader, or expired after the lease TTL",
                )
                .buckets(vec![
                    0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0, 30.0, 60.0,
                ]),
                &["end"],
            ),
        )?;
        let m = Self {
            lease_holds: [
                lease_holds.with_label_values(&["released"]),
                lease_holds.with_label_values(&["expired"]),
            ],
            lookups: [lookup("get"), lookup("exists"), lookup("longest_prefix")],
            soft_pins: g("kvpool_master_soft_pins", "Objects under a soft pin")?,
            segments: g("kvpool_master_segments", "Segments mounted by agents")?,
            node_used: per_node(
                "kvpool_master_node_used_bytes",
                "Allocated bytes per node and tier (over the node's segments)",
            )?,
            node_capacity: per_node(
                "kvpool_master_node_capacity_bytes",
                "Mounted bytes per node and tier (over the node's segments)",
            )?,
            node_series: Default::default(),
            node_get_hits: counters(
                "kvpool_master_node_get_hits_total",
                "Keys whose Get was served from a node, per node and tier (counted on the \
                 replica a reader on none of the replicas' nodes reads: the first DRAM one, \
                 else the first); a Get miss belongs to no node",
                &["node", "tier"],
            )?,
            node_hit_series: Default::default(),
            objects: g("kvpool_master_objects", "Committed objects")?,
            pending_puts: g(
                "kvpool_master_pending_puts",
                "Puts started and not yet ended",
            )?,
            used_bytes: per_tier("kvpool_master_used_bytes", "Allocated bytes per tier")?,
            capacity_bytes: per_tier("kvpool_master_capacity_bytes", "Mounted bytes per tier")?,
            leases: g("kvpool_master_leases", "Active read leases")?,
            under_replicated: g(
                "kvpool_master_under_replicated_objects",
                "Objects with fewer replicas than asked",
            )?,
            tasks: g("kvpool_master_tasks", "Repair and demotion tasks in flight")?,
            nodes_alive: g("kvpool_master_nodes_alive", "Agents heartbeating")?,
            leader: g("kvpool_master_leader", "1 while this master is the leader")?,
            evictions: counters(
                "kvpool_master_evictions_total",
                "Replicas evicted, by policy, tier and outcome",
                &["policy", "tier", "outcome"],
            )?,
            events: counters(
                "kvpool_master_events_total",
                "Background events by kind",
                &["event"],
            )?,
            requests: counters(
                "kvpool_master_requests_total",
                "gRPC calls by method and result",
                &["method", "result"],
            )?,
            latency: reg(
                registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "kvpool_master_request_duration_seconds",
                        "gRPC call latency inside the master",
                    )
                    .buckets(
                        prometheus::exponential_buckets(0.000_01, 4.0, 10)
                            .map_err(MetricsError::Register)?,
                    ),
                    &["method"],
                ),
            )?,
            persist_latency: reg(
                registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "kvpool_master_persist_duration_seconds",
                        "Latency of one etcd write batch",
                    )
                    .buckets(
                        prometheus::exponential_buckets(0.000_1, 4.0, 9)
                            .map_err(MetricsError::Register)?,
                    ),
                ),
            )?,
            fast_connections: g(
                "kvpool_master_fast_lane_connections",
                "Open fast-lane connections (plain-framed calls on the gRPC port)",
            )?,
            fast_refusals: counters(
                "kvpool_master_fast_lane_refusals_total",
                "Fast-lane connections closed for bad input, by reason",
                &["reason"],
            )?,
            conn_refusals: counters(
                "kvpool_master_connections_refused_total",
                "Connections to the gRPC port closed before they authenticated, or idle after, by reason",
                &["reason"],
            )?,
            kv_event_batches: reg(
                registry,
                IntCounter::new(
                    "kvpool_master_kv_event_batches_total",
                    "KV event batches published (pool block events, vLLM's format)",
                ),
            )?,
            kv_events: counters(
                "kvpool_master_kv_events_total",
                "Pool block events published, by kind",
                &["kind"],
            )?,
            kv_event_resyncs: reg(
                registry,
                IntCounter::new(
                    "kvpool_master_kv_event_resyncs_total",
                    "Snapshots published (publisher start, new leader, outbox overflow)",
                ),
            )?,
            policy,
            last: Default::default(),
        };
        Ok(m)
    }

    /// Read leases ended: each one's hold time in ms, and whether it `expired` (else its
    /// reader released it).
    pub fn lease_holds(&self, held_ms: impl IntoIterator<Item = u64>, expired: bool) {
        let h = &self.lease_holds[usize::from(expired)];
        for ms in held_ms {
            h.observe(ms as f64 / 1000.0);
        }
    }

    /// A fast-lane connection opened (`+1`) or closed (`-1`).
    pub fn fast_connection(&self, delta: i64) {
        self.fast_connections.add(delta);
    }

    /// A fast-lane connection closed for bad input (`preface`, `frame`, `unauthenticated`).
    pub fn fast_refused(&self, reason: &str) {
        self.fast_refusals.with_label_values(&[reason]).inc();
    }

    /// A connection closed before it authenticated (`max_connections`, `per_source`,
    /// `silent`, `handshake_timeout`, `grpc_unauthenticated`), or after, for `idle`ness.
    pub fn conn_refused(&self, reason: &str) {
        self.conn_refusals.with_label_values(&[reason]).inc();
    }

    /// The counter of [`Self::conn_refused`] for `reason`, to count from elsewhere.
    pub fn conn_refused_counter(&self, reason: &str) -> prometheus::IntCounter {
        self.conn_refusals.with_label_values(&[reason])
    }

    /// Connections closed before they authenticated, for `reason`.
    pub fn conn_refusals(&self, reason: &str) -> u64 {
        self.conn_refusals.with_label_values(&[reason]).get()
    }

    /// Record one call.
    pub fn observe_call(&self, method: &str, result: &str, seconds: f64) {
        self.requests.with_label_values(&[method, result]).inc();
        self.latency.with_label_values(&[method]).observe(seconds);
    }

    pub fn observe_persist(&self, seconds: f64) {
        self.persist_latency.observe(seconds);
    }

    /// One published KV event batch and its events of each kind (`block_stored` and
    /// `block_removed` counted per block, `all_blocks_cleared` per event).
    pub fn kv_event_batch(&self, kinds: &[(&str, u64)]) {
        self.kv_event_batches.inc();
        for (kind, n) in kinds {
            self.kv_events.with_label_values(&[kind]).inc_by(*n);
        }
    }

    /// A snapshot of the pool's blocks was published.
    pub fn kv_event_resync(&self) {
        self.kv_event_resyncs.inc();
    }

    /// Keys looked up by one call: `hits` found, `misses` not.
    pub fn lookup(&self, call: LookupCall, hits: u64, misses: u64) {
        let [hit, miss] = &self.lookups[call as usize];
        hit.inc_by(hits);
        miss.inc_by(misses);
    }

    /// Keys looked up since this master started, over every call: `(hits, misses)`.
    pub fn lookup_totals(&self) -> (u64, u64) {
        self.lookups.iter().fold((0, 0), |(h, m), [hit, miss]| {
            (h + hit.get(), m + miss.get())
        })
    }

    /// Keys looked up by one kind of call since this master started: `(hits, misses)`.
    pub fn lookup_call_totals(&self, call: LookupCall) -> (u64, u64) {
        let [hit, miss] = &self.lookups[call as usize];
        (hit.get(), miss.get())
    }

    /// The per-node hit counters follow the core's counts in `reports` (live nodes): series of
    /// nodes that left are removed, and a count below the last one seen (a new leader's fresh
    /// state) restarts its series, which Prometheus reads as a counter reset.
    pub fn refresh_node_hits(&self, reports: &[NodeReport]) {
        let mut series = self.node_hit_series.lock();
        let mut now: BTreeMap<(String, &'static str), u64> = BTreeMap::new();
        for r in reports {
            for t in Tier::ALL {
                let hits = r.get_hits[t.index()];
                let key = (r.node.clone(), t.as_str());
                let labels = [r.node.as_str(), t.as_str()];
                match series.get(&key) {
                    Some(before) if *before <= hits => {
                        self.node_get_hits
                            .with_label_values(&labels)
                            .inc_by(hits - before);
                    }
                    Some(_) => {
                        let _ = self.node_get_hits.remove_label_values(&labels);
                        self.node_get_hits.with_label_values(&labels).inc_by(hits);
                    }
                    None => self.node_get_hits.with_label_values(&labels).inc_by(hits),
                }
                now.insert(key, hits);
            }
        }
        for (node, tier) in series.keys() {
            if !now.contains_key(&(node.clone(), *tier)) {
                // Absent series are fine: the map says what was set.
                let _ = self
                    .node_get_hits
                    .remove_label_values(&[node.as_str(), *tier]);
            }
        }
        *series = now;
    }

    /// Per-node gauges follow `usage`; series of nodes or tiers no longer in it are removed.
    pub fn refresh_nodes(&self, usage: &[NodeUsage]) {
        let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let mut series = self.node_series.lock();
        let now: BTreeSet<(String, &'static str)> = usage
            .iter()
            .map(|u| (u.node.clone(), u.tier.as_str()))
            .collect();
        for (node, tier) in series.difference(&now) {
            let labels = [node.as_str(), *tier];
            // Absent series are fine: the set says what was set.
            let _ = self.node_used.remove_label_values(&labels);
            let _ = self.node_capacity.remove_label_values(&labels);
        }
        for u in usage {
            let labels = [u.node.as_str(), u.tier.as_str()];
            self.node_used
                .with_label_values(&labels)
                .set(i(u.used_bytes));
            self.node_capacity
                .with_label_values(&labels)
                .set(i(u.capacity_bytes));
        }
        *series = now;
    }

    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }

    /// Refresh gauges and advance counters from the core's figures.
    pub fn refresh(&self, stats: &Stats, counters: &Counters) {
        let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.objects.set(i(stats.objects));
        self.pending_puts.set(i(stats.pending_puts));
        for (t, name) in ["dram", "ssd"].iter().enumerate() {
            self.used_bytes
                .with_label_values(&[name])
                .set(i(stats.used_bytes[t]));
            self.capacity_bytes
                .with_label_values(&[name])
                .set(i(stats.capacity_bytes[t]));
        }
        self.leases.set(i(stats.leases));
        self.soft_pins.set(i(stats.soft_pins));
        self.segments.set(i(stats.segments));
        self.under_replicated.set(i(stats.under_replicated));
        self.tasks.set(i(stats.tasks));
        self.nodes_alive.set(i(stats.nodes_alive));
        let mut last = self.last.lock();
        let d = |now: u64, before: u64| now.saturating_sub(before);
        for (t, name) in ["dram", "ssd"].iter().enumerate() {
            self.evictions
                .with_label_values(&[self.policy, name, "dropped"])
                .inc_by(d(counters.evicted_dropped[t], last.evicted_dropped[t]));
        }
        self.evictions
            .with_label_values(&[self.policy, "dram", "demoted"])
            .inc_by(d(counters.demoted, last.demoted));
        let events = [
            (
                "demotion_failed",
                counters.demotions_failed,
                last.demotions_failed,
            ),
            ("repair_done", counters.repairs_done, last.repairs_done),
            (
                "repair_failed",
                counters.repairs_failed,
                last.repairs_failed,
            ),
            ("object_lost", counters.objects_lost, last.objects_lost),
            ("node_died", counters.nodes_died, last.nodes_died),
            (
                "node_suspected",
                counters.nodes_suspected,
                last.nodes_suspected,
            ),
            (
                "lease_expired",
                counters.leases_expired,
                last.leases_expired,
            ),
            ("put_expired", counters.puts_expired, last.puts_expired),
            (
                "reuse_deferred",
                counters.reuse_deferred,
                last.reuse_deferred,
            ),
            ("hot_request", counters.hot_requests, last.hot_requests),
            (
                "hot_replica_trimmed",
                counters.hot_replicas_trimmed,
                last.hot_replicas_trimmed,
            ),
        ];
        for (name, now, before) in events {
            self.events
                .with_label_values(&[name])
                .inc_by(d(now, before));
        }
        *last = counters.clone();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_core::master::types::Tier;

    fn exposition(registry: &Registry) -> String {
        let mut text = Vec::new();
        prometheus::Encoder::encode(
            &prometheus::TextEncoder::new(),
            &registry.gather(),
            &mut text,
        )
        .expect("encode");
        String::from_utf8(text).expect("utf-8")
    }

    fn usage(node: &str, tier: Tier, used: u64) -> NodeUsage {
        NodeUsage {
            node: node.into(),
            tier,
            used_bytes: used,
            capacity_bytes: 100,
        }
    }

    #[test]
    fn lookups_add_up_per_call_and_in_total() {
        let registry = Registry::new();
        let m = MasterMetrics::new(&registry, "lru").expect("metrics");
        let text = exposition(&registry);
        // Every call's hit and miss series exist before the first lookup.
        for call in ["get", "exists", "longest_prefix"] {
            for result in ["hit", "miss"] {
                let series = format!(
                    "kvpool_master_lookup_keys_total{{call=\"{call}\",result=\"{result}\"}} 0"
                );
                assert!(text.contains(&series), "{series} in\n{text}");
            }
        }
        m.lookup(LookupCall::Get, 3, 1);
        m.lookup(LookupCall::LongestPrefix, 2, 6);
        m.lookup(LookupCall::Exists, 0, 2);
        assert_eq!(m.lookup_totals(), (5, 9));
        let text = exposition(&registry);
        assert!(
            text.contains(
                "kvpool_master_lookup_keys_total{call=\"longest_prefix\",result=\"miss\"} 6"
            ),
            "{text}"
        );
    }

    #[test]
    fn per_node_gauges_follow_the_nodes_and_drop_those_that_left() {
        let registry = Registry::new();
        let m = MasterMetrics::new(&registry, "lru").expect("metrics");
        m.refresh_nodes(&[
            usage("gpu-0", Tier::Dram, 10),
            usage("gpu-0", Tier::Ssd, 20),
            usage("gpu-1", Tier::Dram, 30),
        ]);
        let text = exposition(&registry);
        assert!(
            text.contains("kvpool_master_node_used_bytes{node=\"gpu-1\",tier=\"dram\"} 30"),
            "{text}"
        );
        m.refresh_nodes(&[usage("gpu-0", Tier::Dram, 15)]);
        let text = exposition(&registry);
        assert!(
            text.contains("kvpool_master_node_used_bytes{node=\"gpu-0\",tier=\"dram\"} 15"),
            "{text}"
        );
        assert!(!text.contains("gpu-1"), "a node that left stays:\n{text}");
        assert!(
            !text.contains("tier=\"ssd\""),
            "a tier that left stays:\n{text}"
        );
        assert!(
            text.contains("kvpool_master_node_capacity_bytes{node=\"gpu-0\",tier=\"dram\"} 100"),
            "{text}"
        );
    }

    fn hits(node: &str, dram: u64, ssd: u64) -> NodeReport {
        NodeReport {
            node: node.into(),
            used_bytes: [0; 2],
            capacity_bytes: [0; 2],
            numa: Vec::new(),
            get_hits: [dram, ssd],
        }
    }

    #[test]
    fn per_node_hit_counters_follow_the_core_and_drop_nodes_that_left() {
        let registry = Registry::new();
        let m = MasterMetrics::new(&registry, "lru").expect("metrics");
        let series = |node: &str, tier: &str| {
            m.node_get_hits
                .get_metric_with_label_values(&[node, tier])
                .map(|c| c.get())
                .ok()
        };
        m.refresh_node_hits(&[hits("gpu-0", 4, 1), hits("gpu-1", 2, 0)]);
        m.refresh_node_hits(&[hits("gpu-0", 7, 1), hits("gpu-1", 2, 0)]);
        assert_eq!(series("gpu-0", "dram"), Some(7));
        assert_eq!(series("gpu-0", "ssd"), Some(1));
        let text = exposition(&registry);
        assert!(
            text.contains("kvpool_master_node_get_hits_total{node=\"gpu-1\",tier=\"dram\"} 2"),
            "{text}"
        );
        // gpu-1 left; a new leader's state counts gpu-0 from 0 again (a counter reset).
        m.refresh_node_hits(&[hits("gpu-0", 3, 0)]);
        assert_eq!(series("gpu-0", "dram"), Some(3));
        let text = exposition(&registry);
        assert!(!text.contains("gpu-1"), "a node that left stays:\n{text}");
    }
}
