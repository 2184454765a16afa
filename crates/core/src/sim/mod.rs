//! Trace simulator: replays a Mooncake-format request trace through the scheduling policy core
//! (`crate::sched`) with simulated prefill and decode instances, and reports hit ratios, TTFT,
//! TPOT, rejections, SLO attainment and prefill and decode instance-seconds, with fixed or
//! autoscaled prefill (`scaling`) and decode (`decode_scaling`) counts. I/O boundary:
//! `trace::load` reads the trace file and the `kvpool simulate` command prints; the engine and
//! the report are pure.

pub mod bench;
pub mod config;
pub mod decode_scaling;
pub mod engine;
pub mod outcome;
pub mod report;
pub mod scaling;
pub mod trace;

pub use config::{SimConfig, UNLIMITED};
pub use engine::{SimError, run, simulate};
pub use outcome::{Outcome, Totals};
pub use report::{Percentiles, Report};
pub use scaling::{AutoscaleConfig, ScalingTotals};
pub use trace::{TraceError, TraceRecord};
