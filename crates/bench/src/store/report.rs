//! What `kvpool bench store` reports: each worker's result of a phase, the figures aggregated
//! over workers and rounds, the Redis baseline's figures and the whole report (JSON, or text
//! for people). Pure but for `/proc/loadavg` and stdout.

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use super::plan::Phase;
use super::{Api, StoreBenchArgs};

/// What one worker reports for one phase.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct PhaseResult {
    /// Successful operations (calls, for the metadata phases).
    pub ops: u64,
    /// Value bytes moved by successful operations.
    pub bytes: u64,
    pub failures: u64,
    /// Gets whose bytes matched what was put.
    pub verified: u64,
    /// Gets that returned other bytes, or lookups that answered other than expected.
    pub mismatches: u64,
    /// Microseconds spent checking gotten bytes with no other operation of the worker in
    /// flight (one call in flight only): taken out of the phase time, as the check is not
    /// part of the operation.
    #[serde(default)]
    pub check_us: u64,
    pub first_error: Option<String>,
    /// Latency histogram (microseconds) as (value, count) pairs of its recorded buckets.
    pub latency_us: Vec<(u64, u64)>,
    /// Master calls the worker's client sent during the phase (coalesced get, put_start,
    /// put_end and lease releases).
    #[serde(default)]
    pub master_calls: u64,
}

/// Aggregated figures of one timed phase.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct PhaseFigures {
    pub ops: u64,
    pub failures: u64,
    pub seconds: f64,
    pub ops_per_second: f64,
    /// Decimal gigabytes (1e9 bytes) per second.
    pub gb_per_second: f64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub first_error: Option<String>,
    /// Master calls per operation (data phases; concurrent calls are coalesced).
    pub master_calls_per_op: f64,
}

/// One value size.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct SizeFigures {
    pub size_bytes: u64,
    pub put: PhaseFigures,
    pub get: PhaseFigures,
    /// Gets whose bytes were compared with what was put and matched.
    pub get_verified: u64,
    pub get_mismatches: u64,
}

/// Metadata lookups.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct LookupFigures {
    pub batch: usize,
    pub exists_calls_per_second: f64,
    pub exists_key_lookups_per_second: f64,
    pub prefix_calls_per_second: f64,
    pub prefix_key_lookups_per_second: f64,
    /// Calls that answered other than "all present" (every looked-up key was committed).
    pub mismatches: u64,
    pub failures: u64,
}

/// Redis baseline.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RedisFigures {
    pub value_bytes: u64,
    pub connections: u32,
    pub requests: u64,
    pub set_ops_per_second: f64,
    pub get_ops_per_second: f64,
    pub set_gb_per_second: f64,
    pub get_gb_per_second: f64,
}

/// Our 1 MiB throughput over Redis's.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Ratio {
    pub put_over_set: f64,
    pub get_over_get: f64,
}

/// The whole run.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct StoreBenchReport {
    pub agents: usize,
    pub clients: usize,
    pub depth: usize,
    pub replicas: u8,
    pub rounds: u32,
    pub api: Api,
    pub transport: &'static str,
    pub values: Vec<SizeFigures>,
    pub lookups: Option<LookupFigures>,
    /// Every get of every size returned exactly the bytes put.
    pub all_gets_verified: bool,
    pub redis: Option<RedisFigures>,
    /// Present when 1 MiB was measured and Redis ran.
    pub ratio_1mib: Option<Ratio>,
    /// Mooncake Store's figures of the same cells (`--vs-mooncake`).
    pub mooncake: Option<super::MooncakeStore>,
    /// kvpool over Mooncake per value size (`--vs-mooncake`; target: rates >= 1.5, p99 <= 1).
    pub ratio_vs_mooncake: Vec<super::CellRatio>,
    pub load_average: Option<[f64; 3]>,
}

pub(super) fn histogram() -> Histogram<u64> {
    // 1 µs to 10 min at 3 significant digits: constant, valid bounds.
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("constant histogram bounds are valid")
}

pub(super) fn encode_histogram(h: &Histogram<u64>) -> Vec<(u64, u64)> {
    h.iter_recorded()
        .map(|v| (v.value_iterated_to(), v.count_at_value()))
        .collect()
}

/// Aggregate the workers' results of a phase that took `seconds` (barrier to last result).
/// The workers run side by side, so the longest time one of them spent checking bytes alone
/// (`check_us`) is taken out of the phase time.
pub fn aggregate(results: &[PhaseResult], seconds: f64) -> PhaseFigures {
    let checking = results.iter().map(|r| r.check_us).max().unwrap_or(0) as f64 / 1e6;
    // Measured inside the phase, so never more than it; the bound only guards the division.
    let seconds = (seconds - checking).max(1e-9);
    let mut h = histogram();
    let (mut ops, mut bytes, mut failures, mut calls) = (0u64, 0u64, 0u64, 0u64);
    let mut first_error = None;
    for r in results {
        ops += r.ops;
        bytes += r.bytes;
        failures += r.failures;
        calls += r.master_calls;
        if first_error.is_none() {
            first_error.clone_from(&r.first_error);
        }
        for &(v, c) in &r.latency_us {
            let _ = h.record_n(v.max(1), c);
        }
    }
    let secs = seconds.max(1e-9);
    PhaseFigures {
        ops,
        failures,
        seconds,
        ops_per_second: ops as f64 / secs,
        gb_per_second: bytes as f64 / secs / 1e9,
        p50_us: h.value_at_quantile(0.5),
        p99_us: h.value_at_quantile(0.99),
        first_error,
        master_calls_per_op: calls as f64 / ops.max(1) as f64,
    }
}

fn load_average() -> Option<[f64; 3]> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut it = s.split_whitespace().map(|v| v.parse::<f64>().ok());
    Some([it.next()??, it.next()??, it.next()??])
}

/// Build the report from the phases' results (pure).
pub fn report(
    args: &StoreBenchArgs,
    phases: &[(Phase, Vec<PhaseResult>, f64)],
    redis: Option<RedisFigures>,
) -> StoreBenchReport {
    let find = |want: Phase| phases.iter().find(|(p, _, _)| *p == want);
    // Every round of a phase: all workers' results and the summed barrier-to-barrier time.
    let rounds = |want: Phase| -> Option<(Vec<PhaseResult>, f64)> {
        let matching: Vec<_> = phases.iter().filter(|(p, _, _)| *p == want).collect();
        (!matching.is_empty()).then(|| {
            (
                matching
                    .iter()
                    .flat_map(|(_, r, _)| r.iter().cloned())
                    .collect(),
                matching.iter().map(|(_, _, t)| t).sum(),
            )
        })
    };
    let mut values = Vec::new();
    let mut all_verified = true;
    for &s in &args.sizes {
        let put = rounds(Phase::Put(s))
            .map(|(r, t)| aggregate(&r, t))
            .unwrap_or_default();
        let (get, verified, mismatches) = rounds(Phase::Get(s)).map_or_else(
            || (PhaseFigures::default(), 0, 0),
            |(r, t)| {
                (
                    aggregate(&r, t),
                    r.iter().map(|x| x.verified).sum(),
                    r.iter().map(|x| x.mismatches).sum(),
                )
            },
        );
        let expected = args.ops_for(s) * args.clients as u64 * u64::from(args.rounds);
        all_verified &= verified == expected && mismatches == 0;
        values.push(SizeFigures {
            size_bytes: s,
            put,
            get,
            get_verified: verified,
            get_mismatches: mismatches,
        });
    }
    let lookups = match (find(Phase::Exists), find(Phase::Prefix)) {
        (Some((_, e, te)), Some((_, p, tp))) => {
            let ea = aggregate(e, *te);
            let pa = aggregate(p, *tp);
            Some(LookupFigures {
                batch: args.batch,
                exists_calls_per_second: ea.ops_per_second,
                exists_key_lookups_per_second: ea.ops_per_second * args.batch as f64,
                prefix_calls_per_second: pa.ops_per_second,
                prefix_key_lookups_per_second: pa.ops_per_second * args.batch as f64,
                mismatches: e.iter().chain(p).map(|r| r.mismatches).sum(),
                failures: ea.failures + pa.failures,
            })
        }
        _ => None,
    };
    let ratio_1mib = redis.as_ref().and_then(|r| {
        let v = values.iter().find(|v| v.size_bytes == r.value_bytes)?;
        Some(Ratio {
            put_over_set: v.put.ops_per_second / r.set_ops_per_second.max(1e-9),
            get_over_get: v.get.ops_per_second / r.get_ops_per_second.max(1e-9),
        })
    });
    StoreBenchReport {
        agents: args.agents,
        clients: args.clients,
        depth: args.depth,
        replicas: args.replicas,
        rounds: args.rounds,
        api: args.api,
        transport: "tcp",
        values,
        lookups,
        all_gets_verified: all_verified,
        redis,
        ratio_1mib,
        mooncake: None,
        ratio_vs_mooncake: Vec::new(),
        load_average: load_average(),
    }
}

pub(super) fn print_text(r: &StoreBenchReport) {
    println!(
        "{} agents, {} client processes x {} in flight, {} replica(s), transport {}, {} API",
        r.agents,
        r.clients,
        r.depth,
        r.replicas,
        r.transport,
        r.api.as_str()
    );
    for v in &r.values {
        for (what, f) in [("put", &v.put), ("get", &v.get)] {
            println!(
                "{what} {:>8} B  {:>9.0} ops/s  {:>6.2} GB/s  p50 {:>6} us  p99 {:>6} us  \
                 master calls/op {:.2}  failures {}",
                v.size_bytes,
                f.ops_per_second,
                f.gb_per_second,
                f.p50_us,
                f.p99_us,
                f.master_calls_per_op,
                f.failures
            );
        }
        println!(
            "    verified gets {} / mismatches {}",
            v.get_verified, v.get_mismatches
        );
    }
    if let Some(l) = &r.lookups {
        println!(
            "exists x{}          {:.0} calls/s = {:.0} key lookups/s",
            l.batch, l.exists_calls_per_second, l.exists_key_lookups_per_second
        );
        println!(
            "longest_prefix x{}  {:.0} calls/s = {:.0} key lookups/s",
            l.batch, l.prefix_calls_per_second, l.prefix_key_lookups_per_second
        );
    }
    if let Some(x) = &r.redis {
        println!(
            "redis 1 MiB x{} conns: SET {:.0} ops/s ({:.2} GB/s), GET {:.0} ops/s ({:.2} GB/s)",
            x.connections,
            x.set_ops_per_second,
            x.set_gb_per_second,
            x.get_ops_per_second,
            x.get_gb_per_second
        );
    }
    if let Some(q) = &r.ratio_1mib {
        println!(
            "1 MiB vs redis: put/SET {:.2}x, get/GET {:.2}x",
            q.put_over_set, q.get_over_get
        );
    }
    if let Some(m) = &r.mooncake {
        println!(
            "Mooncake Store {} ({} holders x {} B, {} in flight):",
            m.mooncake_version, m.holders, m.capacity_per_holder, m.depth
        );
        for v in &m.values {
            for (what, f) in [("put", &v.put), ("get", &v.get)] {
                println!(
                    "{what} {:>8} B  {:>9.0} ops/s  p50 {:>6} us  p99 {:>6} us  failures {}",
                    v.size_bytes, f.ops_per_second, f.p50_us, f.p99_us, f.failures
                );
            }
        }
        for q in &r.ratio_vs_mooncake {
            println!(
                "{:>8} B vs Mooncake: put {:.2}x, get {:.2}x ops/s; p99 put {:.2}, get {:.2}                  (kvpool over Mooncake)",
                q.size_bytes, q.put_ops, q.get_ops, q.put_p99, q.get_p99
            );
        }
    }
    println!("all gets verified: {}", r.all_gets_verified);
}
