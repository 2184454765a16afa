//! `kvpool simulate-cache`: replays a Mooncake trace against one global block cache per
//! eviction policy and capacity and prints hit ratios (`kvpool_core::master::simulate`).
//! Capacities are given in blocks or as percentages of the trace's working set (its distinct
//! blocks). I/O boundary: reads the trace, prints to stdout.

use std::path::PathBuf;

use kvpool_core::flags::FlagError;
use kvpool_core::master::PolicyKind;
use kvpool_core::master::simulate::{
    SimResult, SimulateError, blocks_for_percent, read_trace, simulate, working_set_blocks,
};

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
    #[arg(
        long,
        value_delimiter = ',',
        required_unless_present = "capacity_percent"
    )]
    pub capacity_blocks: Vec<u64>,
    /// Cache capacities as percentages of the trace's working set (distinct blocks), comma
    /// separated, e.g. `5,10,25,50`.
    #[arg(long, value_delimiter = ',')]
    pub capacity_percent: Vec<f64>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Errors of `kvpool simulate-cache`.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum SimulateCacheError {
    #[error(transparent)]
    Flag(FlagError),
    #[error(transparent)]
    Simulate(SimulateError),
}

/// One row of the report: the replay and, when the capacity was a percentage, that percentage.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Row {
    #[serde(flatten)]
    pub result: SimResult,
    pub capacity_percent: Option<f64>,
    pub working_set_blocks: u64,
}

/// Run `kvpool simulate-cache` and print the results to stdout.
pub fn run(args: &SimulateCacheArgs) -> Result<Vec<Row>, SimulateCacheError> {
    if let Some(p) = args
        .capacity_percent
        .iter()
        .find(|p| !(p.is_finite() && **p > 0.0))
    {
        return Err(SimulateCacheError::Flag(FlagError::new(
            "capacity-percent",
            format!("{p} is not a percentage above 0"),
        )));
    }
    let trace = read_trace(&args.trace).map_err(SimulateCacheError::Simulate)?;
    let working_set = working_set_blocks(&trace);
    let capacities: Vec<(Option<u64>, Option<f64>)> = args
        .capacity_blocks
        .iter()
        .map(|&c| ((c > 0).then_some(c), None))
        .chain(
            args.capacity_percent
                .iter()
                .map(|&p| (Some(blocks_for_percent(working_set, p)), Some(p))),
        )
        .collect();
    let mut rows = Vec::new();
    for &policy in &args.policy {
        for &(cap, percent) in &capacities {
            rows.push(Row {
                result: simulate(&trace, policy, cap).map_err(SimulateCacheError::Simulate)?,
                capacity_percent: percent,
                working_set_blocks: working_set,
            });
        }
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&rows).unwrap_or_default()
        );
    } else {
        println!("working set: {working_set} blocks");
        println!(
            "{:<8} {:>10} {:>8} {:>10} {:>10} {:>9} {:>10}",
            "policy", "capacity", "percent", "blocks", "hits", "hit_ratio", "evictions"
        );
        for row in &rows {
            let r = &row.result;
            let cap = r
                .capacity_blocks
                .map_or_else(|| "inf".to_owned(), |c| c.to_string());
            let percent = row
                .capacity_percent
                .map_or_else(|| "-".to_owned(), |p| format!("{p}%"));
            println!(
                "{:<8} {:>10} {:>8} {:>10} {:>10} {:>9.4} {:>10}",
                r.policy.as_str(),
                cap,
                percent,
                r.blocks,
                r.hit_blocks,
                r.hit_ratio,
                r.evictions
            );
        }
    }
    Ok(rows)
}
