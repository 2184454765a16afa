//! What one simulation run is configured with: the scheduler's configuration, the decode
//! instances, the cache and pool capacities, the time scale and the prefill and decode
//! autoscaling. Pure data, built by the `kvpool simulate` command line and by tests.

use super::scaling::AutoscaleConfig;
use crate::sched::SchedulerConfig;

/// Capacity value meaning "no limit".
pub const UNLIMITED: usize = usize::MAX;

/// Everything one simulation run needs.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SimConfig {
    pub scheduler: SchedulerConfig,
    pub decode_instances: usize,
    /// Blocks each prefill instance caches locally (`UNLIMITED` for no limit).
    pub local_cache_blocks: usize,
    /// Blocks the global pool holds (`UNLIMITED` for no limit); unused by `local-only`.
    pub pool_blocks: usize,
    /// Arrival times are divided by this (2.0 replays twice as fast).
    pub time_scale: f64,
    /// Scale the prefill instances (the scheduler's `prefill_costs` has one per instance up
    /// to `max`); `None`: all of them serve all the time.
    pub autoscale: Option<AutoscaleConfig>,
    /// Scale the decode instances (`decode_instances` is `max`); `None`: all of them serve all
    /// the time.
    pub autoscale_decode: Option<AutoscaleConfig>,
}
