//! `kvpool bench sched`: latency of one scheduling decision against a large prefix index (the
//! benchmark `kvpool simulate --bench-decision` also runs), with its own flags. I/O boundary:
//! stdout only; the work is `sim::bench`.

mod events;

use events::EventStream;
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
    /// Block events (vLLM-format KV events, decoded and applied to the index) streamed in
    /// before every decision; the report adds their ingestion rate.
    #[arg(long, default_value_t = 0)]
    pub events_per_decision: usize,
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

kvpool_runtime::error_category!(SchedBenchError);

/// Runs the benchmark and returns what to print.
pub fn execute(args: &SchedBenchArgs) -> Result<String, SchedBenchError> {
    let config = BenchConfig {
        prefill_instances: args.prefill,
        decode_instances: args.decode,
        blocks: args.blocks,
        decisions: args.decisions,
        seed: args.seed,
        ..BenchConfig::default()
    };
    let mut stream: Option<EventStream> = None;
    let report = bench::run_with(config, &mut |index, keys| {
        if args.events_per_decision == 0 {
            return;
        }
        stream
            .get_or_insert_with(|| {
                EventStream::new(
                    keys,
                    config.chain_blocks,
                    config.prefill_instances,
                    args.events_per_decision,
                )
            })
            .apply(index);
    })
    .map_err(SchedBenchError::Bench)?;
    let events = stream.as_ref().map(|s| {
        serde_json::json!({
            "events_per_decision": args.events_per_decision,
            "block_events": s.block_events,
            "events_per_second": s.events_per_second(),
        })
    });
    if args.json {
        let mut v = serde_json::to_value(&report).map_err(SchedBenchError::Json)?;
        if let (Some(obj), Some(e)) = (v.as_object_mut(), events) {
            obj.insert("kv_events".into(), e);
        }
        serde_json::to_string_pretty(&v).map_err(SchedBenchError::Json)
    } else {
        let mut text = report.to_text();
        if let Some(s) = &stream {
            text.push_str(&format!(
                "\nKV events: {} block events applied between decisions, {:.0} events/s\n",
                s.block_events,
                s.events_per_second()
            ));
        }
        Ok(text)
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
            events_per_decision: 0,
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

    #[test]
    fn events_stream_into_the_index_between_decisions() {
        let args = SchedBenchArgs {
            prefill: 8,
            decode: 4,
            blocks: 4_000,
            decisions: 100,
            seed: 5,
            events_per_decision: 64,
            json: true,
        };
        let v: serde_json::Value = serde_json::from_str(&execute(&args).unwrap()).unwrap();
        let e = &v["kv_events"];
        // 64 events a decision: two batches of a 16-block stored and a 16-block removed run.
        assert_eq!(e["block_events"], 100 * 64, "{v}");
        assert!(e["events_per_second"].as_f64().unwrap() > 0.0, "{v}");
    }
}
