//! `kvpool bench sched`: latency of one scheduling decision against a large prefix index (the
//! benchmark `kvpool simulate --bench-decision` also runs), with its own flags. I/O boundary:
//! stdout only; the work is `sim::bench`.

use kvpool_core::sim::bench::{self, BenchConfig, BenchError};

/// Flags of `kvpool bench sched`.
#[derive(Debug, Clone, clap::Args)]
pub struct SchedBenchArgs {
    /// Prefill instances.
    #[arg(long, default_value_t = BenchConfig::default().prefill_instances)]
    pub prefill: usize,
    /// Decode instances.
    #[arg(long, default_value_t = BenchConfig::default().decode_instances)]
    pub decode: usize,
    /// Blocks in the prefix index.
    #[arg(long, default_value_t = BenchConfig::default().blocks)]
    pub blocks: usize,
    /// Decisions to time.
    #[arg(long, default_value_t = BenchConfig::default().decisions)]
    pub decisions: usize,
    /// Random seed of the generated index and requests.
    #[arg(long, default_value_t = BenchConfig::default().seed)]
    pub seed: u64,
    /// Print the figures as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Errors of `kvpool bench sched`.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum SchedBenchError {
    #[error("decision benchmark")]
    Bench(#[source] BenchError),
    #[error("cannot encode the report as JSON")]
    Json(#[source] serde_json::Error),
}

impl SchedBenchError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// Runs the benchmark and returns what to print.
pub fn execute(args: &SchedBenchArgs) -> Result<String, SchedBenchError> {
    let report = bench::run(BenchConfig {
        prefill_instances: args.prefill,
        decode_instances: args.decode,
        blocks: args.blocks,
        decisions: args.decisions,
        seed: args.seed,
        ..BenchConfig::default()
    })
    .map_err(SchedBenchError::Bench)?;
    if args.json {
        serde_json::to_string_pretty(&report).map_err(SchedBenchError::Json)
    } else {
        Ok(report.to_text())
    }
}

/// Entry point of `kvpool bench sched`.
pub fn run(args: &SchedBenchArgs) -> Result<(), SchedBenchError> {
    println!("{}", execute(args)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_run_reports_every_decision() {
        let args = SchedBenchArgs {
            prefill: 4,
            decode: 4,
            blocks: 2_000,
            decisions: 200,
            seed: 3,
            json: true,
        };
        let v: serde_json::Value = serde_json::from_str(&execute(&args).unwrap()).unwrap();
        assert_eq!(v["config"]["decisions"], 200, "{v}");
        assert_eq!(v["config"]["prefill_instances"], 4, "{v}");
        assert!(v["indexed_blocks"].as_u64().unwrap() > 0, "{v}");
        assert!(
            v["p99_us"].as_f64().unwrap() >= v["p50_us"].as_f64().unwrap(),
            "{v}"
        );
        let bad = SchedBenchArgs {
            decisions: 0,
            ..args
        };
        assert_eq!(execute(&bad).unwrap_err().category(), "bench");
    }
}
