//! The Redis baseline of `kvpool bench store`: Debian's `redis-server` on a free loopback port,
//! measured with `redis-benchmark` (SET and GET of 1 MiB values over 4 connections), and the
//! parser of its CSV output. I/O boundary: the two child processes.

use std::path::Path;
use std::process::{Command, Stdio};

use kvpool_harness::{Launcher, Probe};

use super::report::RedisFigures;
use super::{START_TIMEOUT, StoreBenchError};

/// Parse `redis-benchmark --csv` output into (test name, requests per second) pairs.
/// Redis 7 prints a header row and quoted fields; rows whose second field is not a number
/// (the header) are skipped.
pub fn parse_redis_csv(out: &str) -> Vec<(String, f64)> {
    out.lines()
        .filter_map(|line| {
            let mut fields = line.split(',').map(|f| f.trim().trim_matches('"'));
            let name = fields.next()?.to_owned();
            let rps: f64 = fields.next()?.parse().ok()?;
            (!name.is_empty() && rps.is_finite()).then_some((name, rps))
        })
        .collect()
}

/// Start `redis-server` on a free loopback port and run `redis-benchmark` against it.
pub(super) fn redis_baseline(dir: &Path, requests: u64) -> Result<RedisFigures, StoreBenchError> {
    const VALUE: u64 = 1 << 20;
    const CONNECTIONS: u32 = 4;
    let addr = kvpool_harness::free_addr().map_err(StoreBenchError::Process)?;
    let port = addr.port().to_string();
    let mut server = Launcher::new(dir)
        .spawn(
            "redis-server",
            Command::new("redis-server")
                .args(["--port", &port, "--bind", "127.0.0.1", "--save", ""])
                .args(["--appendonly", "no", "--protected-mode", "no"])
                .arg("--dir")
                .arg(dir),
        )
        .map_err(|e| {
            StoreBenchError::Redis(format!("{e} (install the Debian package redis-server)"))
        })?;
    server
        .wait_ready(&Probe::Tcp(addr), START_TIMEOUT)
        .map_err(|e| StoreBenchError::Redis(format!("redis-server never listened: {e}")))?;
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port])
        .args(["-d", &VALUE.to_string(), "-c", &CONNECTIONS.to_string()])
        .args(["-t", "set,get", "-n", &requests.to_string(), "--csv"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| StoreBenchError::Redis(format!("running redis-benchmark: {e}")))?;
    drop(server);
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(StoreBenchError::Redis(format!(
            "redis-benchmark exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let rows = parse_redis_csv(&text);
    let rps = |name: &str| {
        rows.iter()
            .find(|(n, _)| n == name)
            .map(|(_, r)| *r)
            .ok_or_else(|| StoreBenchError::Redis(format!("no {name} row in {text:?}")))
    };
    let (set, get) = (rps("SET")?, rps("GET")?);
    Ok(RedisFigures {
        value_bytes: VALUE,
        connections: CONNECTIONS,
        requests,
        set_ops_per_second: set,
        get_ops_per_second: get,
        set_gb_per_second: set * VALUE as f64 / 1e9,
        get_gb_per_second: get * VALUE as f64 / 1e9,
    })
}
