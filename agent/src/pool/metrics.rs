//! Metrics of pool membership (`kvpool_agent_pool_` prefix), registered into the admin
//! server's registry and shared by the link, the task runner and the SSD guard. I/O boundary:
//! none.

use prometheus::{IntCounter, IntCounterVec, IntGauge, Registry};

use kvpool_runtime::metrics::{counter, counters, gauge};

/// Metrics of pool membership (`kvpool_agent_pool_` prefix).
#[derive(Clone, Debug)]
pub struct PoolMetrics {
    /// `kvpool_agent_pool_mounted_segments`
    pub mounted_segments: IntGauge,
    /// `kvpool_agent_pool_heartbeat_failures_total`
    pub heartbeat_failures: IntCounter,
    /// `kvpool_agent_pool_remounts_total`: the master had forgotten this node.
    pub remounts: IntCounter,
    /// `kvpool_agent_pool_tasks_total{kind, outcome}`
    pub tasks: IntCounterVec,
    /// `kvpool_agent_pool_tasks_running`
    pub tasks_running: IntGauge,
    /// `kvpool_agent_pool_task_bytes_total{kind}`: bytes copied by successful tasks.
    pub task_bytes: IntCounterVec,
    /// `kvpool_agent_pool_rdma_fallback`: 1 once the transfer engine reached a peer over TCP
    /// although RDMA was wanted.
    pub rdma_fallback: IntGauge,
    /// `kvpool_agent_pool_ssd_blocks_dropped_total{reason}`: indexed SSD blocks dropped
    /// (corrupt, truncated, out_of_bounds at start-up; refused by the master at adoption).
    pub ssd_blocks_dropped: IntCounterVec,
    /// `kvpool_agent_pool_ssd_blocks_adopted_total`: recovered SSD blocks the master adopted.
    pub ssd_blocks_adopted: IntCounter,
    /// `kvpool_agent_pool_ssd_index_blocks`: blocks in the durable SSD index as of its last
    /// sync.
    pub ssd_index_blocks: IntGauge,
    /// `kvpool_agent_pool_ssd_reads_checked_total{outcome}`: reads of the SSD segment checked
    /// before serving (ok, recent, unindexed, straddles, corrupt, truncated, error).
    pub ssd_reads_checked: IntCounterVec,
    /// `kvpool_agent_pool_ssd_feed_events_total{kind}`: master feed events applied to the SSD
    /// index (commit, free, reset, reset_done).
    pub ssd_feed_events: IntCounterVec,
    /// `kvpool_agent_pool_ssd_reports_dropped_total`: corrupt-block reports dropped because
    /// too many were waiting for the master.
    pub ssd_reports_dropped: IntCounter,
    /// `kvpool_agent_pool_dram_blocks_dropped_total{reason}`: indexed blocks of the persistent
    /// DRAM tier dropped (corrupt, truncated, out_of_bounds at start-up; refused at adoption).
    pub dram_blocks_dropped: IntCounterVec,
    /// `kvpool_agent_pool_dram_blocks_adopted_total`: blocks of the persistent DRAM tier the
    /// master adopted after a mount.
    pub dram_blocks_adopted: IntCounter,
    /// `kvpool_agent_pool_dram_index_blocks`: blocks in the durable indexes of the persistent
    /// DRAM tier as of their last sync.
    pub dram_index_blocks: IntGauge,
    /// `kvpool_agent_pool_ssd_commits_confirmed_total`: feed commits (checksummed from the
    /// file) that a later complete feed answer confirmed, written to the durable index.
    pub ssd_commits_confirmed: IntCounter,
}

impl PoolMetrics {
    /// Create the metrics and register them into `registry`.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        Ok(Self {
            mounted_segments: gauge(
                registry,
                "kvpool_agent_pool_mounted_segments",
                "Segments of this agent currently mounted with the master.",
            )?,
            heartbeat_failures: counter(
                registry,
                "kvpool_agent_pool_heartbeat_failures_total",
                "Heartbeats the master did not accept.",
            )?,
            remounts: counter(
                registry,
                "kvpool_agent_pool_remounts_total",
                "Times the master no longer knew this node and its segments were mounted again.",
            )?,
            tasks: counters(
                registry,
                "kvpool_agent_pool_tasks_total",
                "Master tasks finished, by kind and outcome.",
                &["kind", "outcome"],
            )?,
            tasks_running: gauge(
                registry,
                "kvpool_agent_pool_tasks_running",
                "Master tasks accepted and not finished yet.",
            )?,
            task_bytes: counters(
                registry,
                "kvpool_agent_pool_task_bytes_total",
                "Bytes copied by successful master tasks.",
                &["kind"],
            )?,
            rdma_fallback: gauge(
                registry,
                "kvpool_agent_pool_rdma_fallback",
                "1 when the transfer engine fell back from RDMA to TCP.",
            )?,
            ssd_blocks_dropped: counters(
                registry,
                "kvpool_agent_pool_ssd_blocks_dropped_total",
                "Indexed SSD blocks dropped, by reason (corrupt, truncated, out_of_bounds, \
                 refused).",
                &["reason"],
            )?,
            ssd_blocks_adopted: counter(
                registry,
                "kvpool_agent_pool_ssd_blocks_adopted_total",
                "Recovered SSD blocks the master adopted after a mount.",
            )?,
            ssd_index_blocks: gauge(
                registry,
                "kvpool_agent_pool_ssd_index_blocks",
                "Blocks in the durable index of the pool-mode SSD segment.",
            )?,
            ssd_reads_checked: counters(
                registry,
                "kvpool_agent_pool_ssd_reads_checked_total",
                "Reads of the pool SSD segment checked before serving, by outcome.",
                &["outcome"],
            )?,
            ssd_feed_events: counters(
                registry,
                "kvpool_agent_pool_ssd_feed_events_total",
                "Master segment-feed events applied to the SSD index, by kind.",
                &["kind"],
            )?,
            ssd_reports_dropped: counter(
                registry,
                "kvpool_agent_pool_ssd_reports_dropped_total",
                "Corrupt-block reports dropped because too many were waiting for the master.",
            )?,
            dram_blocks_dropped: counters(
                registry,
                "kvpool_agent_pool_dram_blocks_dropped_total",
                "Indexed blocks of the persistent DRAM tier dropped, by reason (corrupt, \
                 truncated, out_of_bounds, refused).",
                &["reason"],
            )?,
            dram_blocks_adopted: counter(
                registry,
                "kvpool_agent_pool_dram_blocks_adopted_total",
                "Blocks of the persistent DRAM tier the master adopted after a mount.",
            )?,
            dram_index_blocks: gauge(
                registry,
                "kvpool_agent_pool_dram_index_blocks",
                "Blocks in the durable indexes of the persistent DRAM tier.",
            )?,
            ssd_commits_confirmed: counter(
                registry,
                "kvpool_agent_pool_ssd_commits_confirmed_total",
                "Feed commits of the SSD segment confirmed by a later feed answer and made \
                 durable.",
            )?,
        })
    }

    /// The adoption counter, drop counter and index gauge of segment `name`'s tier (`ssd0` or a
    /// persistent DRAM segment).
    pub fn persistence(&self, name: &str) -> (&IntCounter, &IntCounterVec, &IntGauge) {
        if name == super::SSD_SEGMENT {
            (
                &self.ssd_blocks_adopted,
                &self.ssd_blocks_dropped,
                &self.ssd_index_blocks,
            )
        } else {
            (
                &self.dram_blocks_adopted,
                &self.dram_blocks_dropped,
                &self.dram_index_blocks,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_register_once() {
        let registry = Registry::new();
        PoolMetrics::new(&registry).expect("metrics");
        assert!(
            PoolMetrics::new(&registry).is_err(),
            "duplicate names refused"
        );
    }
}
