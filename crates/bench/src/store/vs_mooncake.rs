//! `kvpool bench store --vs-mooncake`: Mooncake Store measured in the same run, with the same
//! value sizes, operations, operations in flight, holders and capacity, by a Python caller of
//! its public API (`mooncake_store.py`, built into this binary and written to the run's temp
//! dir). Runs after kvpool's processes are gone, so the two sides never share the cores.
//! I/O boundary: the driver's child process (and its own children), its stdout.

use std::path::Path;
use std::process::Command;

use serde::{Deserialize, Serialize};

use super::{StoreBenchArgs, StoreBenchError};
use crate::mooncake::{self, Mooncake};

/// The driver, run with the venv's Python.
pub(crate) const SCRIPT: &str = include_str!("mooncake_store.py");

/// One phase of one value size on Mooncake's side.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MooncakePhase {
    pub ops: u64,
    pub failures: u64,
    pub seconds: f64,
    pub ops_per_second: f64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub first_error: Option<String>,
    /// Gets whose bytes equalled what their thread put (every get is compared, outside its
    /// latency and the phase time); 0 for puts.
    #[serde(default)]
    pub verified: u64,
}

/// One value size on Mooncake's side.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct MooncakeSize {
    pub size_bytes: u64,
    pub put: MooncakePhase,
    pub get: MooncakePhase,
}

/// Mooncake's side of the run, as its driver reports it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct MooncakeStore {
    pub mooncake_version: String,
    pub depth: usize,
    pub holders: usize,
    pub capacity_per_holder: u64,
    pub values: Vec<MooncakeSize>,
}

/// kvpool over Mooncake for one value size: operation rates (higher is better for kvpool
/// above 1) and p99 latencies (kvpool's over Mooncake's: at most 1 is not worse).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct CellRatio {
    pub size_bytes: u64,
    pub put_ops: f64,
    pub get_ops: f64,
    pub put_p99: f64,
    pub get_p99: f64,
}

/// Parse the driver's output: its last line is the JSON object.
pub fn parse_driver_output(stdout: &str) -> Result<MooncakeStore, String> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or("the Mooncake driver printed no JSON")?;
    serde_json::from_str(line).map_err(|e| format!("the Mooncake driver's JSON: {e}"))
}

/// Run Mooncake's side of every value size.
pub(super) fn run(args: &StoreBenchArgs, dir: &Path) -> Result<MooncakeStore, StoreBenchError> {
    let peer = |e: String| StoreBenchError::Protocol(format!("Mooncake side: {e}"));
    let mc = Mooncake::find_or_install(args.mooncake.mooncake_venv.as_deref())
        .map_err(|e| peer(e.to_string()))?;
    let script = dir.join("mooncake_store.py");
    std::fs::write(&script, SCRIPT).map_err(StoreBenchError::Io)?;
    let logs = dir.join("mooncake-logs");
    std::fs::create_dir_all(&logs).map_err(StoreBenchError::Io)?;
    let join = |v: Vec<u64>| v.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let sizes = join(args.sizes.clone());
    let ops = join(
        args.sizes
            .iter()
            .map(|&s| args.ops_for(s) * args.clients as u64)
            .collect(),
    );
    let out = Command::new(mc.bin("python"))
        .arg(&script)
        .arg("driver")
        .arg("--master-bin")
        .arg(mc.bin("mooncake_master"))
        .args(["--sizes", &sizes, "--ops", &ops])
        .args(["--depth", &(args.depth * args.clients).to_string()])
        .args(["--holders", &args.agents.to_string()])
        .args(["--capacity", &args.agent_capacity.to_string()])
        .arg("--logs")
        .arg(&logs)
        .output()
        .map_err(StoreBenchError::Io)?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(peer(format!(
            "the driver failed ({}): {}",
            out.status,
            mooncake::tail(&String::from_utf8_lossy(&out.stderr), 2000)
        )));
    }
    parse_driver_output(&stdout).map_err(peer)
}

/// kvpool's figures over Mooncake's, per value size both measured.
pub fn ratios(ours: &[super::SizeFigures], theirs: &MooncakeStore) -> Vec<CellRatio> {
    let over = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    ours.iter()
        .filter_map(|v| {
            let m = theirs
                .values
                .iter()
                .find(|m| m.size_bytes == v.size_bytes)?;
            Some(CellRatio {
                size_bytes: v.size_bytes,
                put_ops: over(v.put.ops_per_second, m.put.ops_per_second),
                get_ops: over(v.get.ops_per_second, m.get.ops_per_second),
                put_p99: over(v.put.p99_us as f64, m.put.p99_us as f64),
                get_p99: over(v.get.p99_us as f64, m.get.p99_us as f64),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_drivers_last_json_line_is_its_report() {
        let out = "noise\n{\"mooncake_version\": \"0.3.13.post1\", \"depth\": 1, \"holders\": 2, \
                   \"capacity_per_holder\": 1024, \"values\": [{\"size_bytes\": 65536, \
                   \"put\": {\"ops\": 10, \"failures\": 0, \"seconds\": 0.5, \"ops_per_second\": 20.0, \
                   \"p50_us\": 300, \"p99_us\": 900, \"first_error\": null}, \
                   \"get\": {\"ops\": 10, \"failures\": 0, \"seconds\": 0.25, \"ops_per_second\": 40.0, \
                   \"p50_us\": 200, \"p99_us\": 500, \"first_error\": null, \"verified\": 10}}]}\n";
        let m = parse_driver_output(out).unwrap();
        assert_eq!(m.values[0].get.ops_per_second, 40.0);
        assert_eq!(m.holders, 2);
        assert!(parse_driver_output("no json here").is_err());
        assert!(parse_driver_output("{\"broken\": ").is_err());
    }
}
