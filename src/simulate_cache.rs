//! `kvpool simulate-cache`: replays a Mooncake trace against one global block cache per
//! eviction policy and capacity and prints hit ratios (`kvpool_core::master::simulate`).
//! I/O boundary: reads the trace, prints to stdout.

use std::path::PathBuf;

use kvpool_core::master::PolicyKind;
use kvpool_core::master::simulate::{SimResult, SimulateError, read_trace, simulate};

/// Arguments of `kvpool simulate-cache`.
#[derive(Debug, Clone, clap::Args)]
pub struct SimulateCacheArgs {
    /// Mooncake trace (JSON lines with `hash_ids`).
    #[arg(long)]
    pub trace: PathBuf,
    /// Eviction policies to compare (comma separated).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "lru")]
    pub policy: Vec<PolicyKind>,
    /// Cache capacities in blocks (comma separated); 0 means unlimited.
    #[arg(long, value_delimiter = ',', required = true)]
    pub capacity_blocks: Vec<u64>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Run `kvpool simulate-cache` and print the results to stdout.
pub fn run(args: &SimulateCacheArgs) -> Result<Vec<SimResult>, SimulateError> {
    let trace = read_trace(&args.trace)?;
    let mut results = Vec::new();
    for &policy in &args.policy {
        for &cap in &args.capacity_blocks {
            results.push(simulate(&trace, policy, (cap > 0).then_some(cap))?);
        }
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&results).unwrap_or_default()
        );
    } else {
        println!(
            "{:<8} {:>10} {:>10} {:>10} {:>9} {:>10}",
            "policy", "capacity", "blocks", "hits", "hit_ratio", "evictions"
        );
        for r in &results {
            let cap = r
                .capacity_blocks
                .map_or_else(|| "inf".to_owned(), |c| c.to_string());
            println!(
                "{:<8} {:>10} {:>10} {:>10} {:>9.4} {:>10}",
                r.policy.as_str(),
                cap,
                r.blocks,
                r.hit_blocks,
                r.hit_ratio,
                r.evictions
            );
        }
    }
    Ok(results)
}
