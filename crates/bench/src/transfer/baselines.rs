//! The baselines `kvpool bench transfer` is measured against in the same run: single-stream
//! loopback iperf3 (for TCP) and single-thread memcpy (for shared memory). I/O boundary: the
//! `iperf3` child processes; memcpy is pure CPU.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{TransferBenchArgs, TransferBenchError};

/// Baseline figures measured in the same run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Baselines {
    /// Single-stream loopback iperf3 throughput, GB/s: mean of `iperf3_runs` (None if iperf3
    /// could not run).
    pub iperf3_gb_per_s: Option<f64>,
    pub iperf3_runs: Vec<f64>,
    pub iperf3_error: Option<String>,
    /// Single-thread memcpy bandwidth, GB/s: mean of `memcpy_runs`.
    pub memcpy_gb_per_s: f64,
    pub memcpy_runs: Vec<f64>,
}

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

impl Baselines {
    /// Combine two measurements (before and after the transfers).
    pub fn merge(mut self, other: Baselines) -> Baselines {
        self.iperf3_runs.extend(other.iperf3_runs);
        self.memcpy_runs.extend(other.memcpy_runs);
        self.iperf3_gb_per_s = mean(&self.iperf3_runs);
        self.memcpy_gb_per_s = mean(&self.memcpy_runs).unwrap_or(0.0);
        self.iperf3_error = self.iperf3_error.or(other.iperf3_error);
        self
    }
}

pub(super) fn measure_baselines(args: &TransferBenchArgs) -> Result<Baselines, TransferBenchError> {
    let d = args.baseline_duration;
    let (iperf3_gb_per_s, iperf3_error) = match iperf3_loopback(d) {
        Ok(v) => (Some(v), None),
        Err(e) => (None, Some(e)),
    };
    let memcpy = memcpy_bandwidth(args.block_size, d);
    Ok(Baselines {
        iperf3_gb_per_s,
        iperf3_runs: iperf3_gb_per_s.into_iter().collect(),
        iperf3_error,
        memcpy_gb_per_s: memcpy,
        memcpy_runs: vec![memcpy],
    })
}

/// Single-thread memcpy bandwidth (bytes copied per second, GB/s) with `block`-sized copies
/// between two 64 MiB buffers (larger than the caches).
pub fn memcpy_bandwidth(block: u64, duration: Duration) -> f64 {
    const BUF: usize = 64 << 20;
    let block = (block as usize).clamp(1, BUF);
    let src = vec![0x11u8; BUF];
    let mut dst = vec![0u8; BUF];
    let mut copied = 0u64;
    let start = Instant::now();
    let mut off = 0usize;
    while start.elapsed() < duration {
        for _ in 0..16 {
            if off + block > BUF {
                off = 0;
            }
            dst[off..off + block].copy_from_slice(&src[off..off + block]);
            off += block;
            copied += block as u64;
        }
    }
    std::hint::black_box(&dst);
    copied as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// Run `iperf3 -s` and `iperf3 -c 127.0.0.1 -J` on a free port; returns GB/s received.
pub fn iperf3_loopback(duration: Duration) -> Result<f64, String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .port();
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start iperf3 (install Debian's iperf3): {e}"))?;
    let secs = duration.as_secs().max(1).to_string();
    let mut result = Err("iperf3 client did not run".to_owned());
    for _ in 0..50 {
        let out = Command::new("iperf3")
            .args([
                "-c",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "-J",
                "-t",
                &secs,
            ])
            .output();
        result = match out {
            Ok(o) => parse_iperf3_json(&String::from_utf8_lossy(&o.stdout)),
            Err(e) => Err(e.to_string()),
        };
        if result.is_ok() {
            break;
        }
        // The server may not be listening yet.
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = server.kill();
    let _ = server.wait();
    result
}

/// Extract the receiver-side throughput (GB/s) from `iperf3 -J` output.
pub fn parse_iperf3_json(text: &str) -> Result<f64, String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("iperf3 output is not JSON: {e}"))?;
    if let Some(err) = v.get("error").and_then(|e| e.as_str()) {
        return Err(format!("iperf3: {err}"));
    }
    v.pointer("/end/sum_received/bits_per_second")
        .and_then(|b| b.as_f64())
        .map(|bps| bps / 8.0 / 1e9)
        .ok_or_else(|| "iperf3 JSON lacks end.sum_received.bits_per_second".into())
}
