//! Trace simulator: replays a Mooncake-format request trace through the scheduling policy core
//! (`crate::sched`) with simulated prefill and decode instances, and reports hit ratios, TTFT,
//! TPOT, rejections and SLO attainment. I/O boundary: `trace::load` reads the trace file and
//! the `kvpool simulate` command prints; the engine and the report are pure.

pub mod bench;
pub mod engine;
pub mod report;
pub mod trace;

pub use engine::{Outcome, SimConfig, SimError, Totals, UNLIMITED, run, simulate};
pub use report::{Percentiles, Report};
pub use trace::{TraceError, TraceRecord};
