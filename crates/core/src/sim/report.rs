//! Simulation report: requests served and rejected, block hit ratios (global and per tier),
//! TTFT/TPOT percentiles, SLO attainment and effective throughput; as JSON or text. Pure.

use std::fmt::Write as _;

use crate::quantile::nearest_rank;
use crate::sched::{Policy, RejectReason, Rejection};

use super::config::SimConfig;
use super::outcome::{Outcome, Totals};
use super::scaling::ScalingTotals;

/// Percentiles of a sample (nearest rank), in seconds. All zero for an empty sample.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

impl Percentiles {
    /// Percentiles of `values` (sorted in place).
    pub fn of(values: &mut [f64]) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort_by(f64::total_cmp);
        let rank = |q: f64| nearest_rank(values, q).unwrap_or_default();
        Self {
            p50: rank(0.5),
            p90: rank(0.9),
            p99: rank(0.99),
            mean: values.iter().sum::<f64>() / values.len() as f64,
        }
    }
}

/// Result of one simulation run.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Report {
    pub policy: Policy,
    pub rejection: Rejection,
    pub prefill_instances: usize,
    pub decode_instances: usize,
    pub requests: usize,
    pub served: usize,
    pub rejected: usize,
    pub rejected_ttft: usize,
    pub rejected_tpot: usize,
    pub rejected_decode_memory: usize,
    /// Blocks of the served requests.
    pub blocks: u64,
    /// Share of those blocks found in cache (local or pool) as part of a cached prefix.
    pub block_hit_ratio: f64,
    /// Share found in the chosen instance's local cache.
    pub local_hit_ratio: f64,
    /// Share fetched from the global pool.
    pub pool_hit_ratio: f64,
    /// Share of prompt tokens that needed no prefill.
    pub token_hit_ratio: f64,
    pub ttft_s: Percentiles,
    pub tpot_s: Percentiles,
    /// Served requests meeting the TTFT SLO, the TPOT SLO, and both.
    pub met_ttft: usize,
    pub met_tpot: usize,
    pub met_both: usize,
    /// `met_both / requests`.
    pub slo_attainment: f64,
    /// First arrival to last completion, seconds of (scaled) trace time.
    pub makespan_s: f64,
    /// `met_both / makespan_s`.
    pub effective_throughput_rps: f64,
    /// What the run spent beyond the requests: prefill busy time, decode steps, replication,
    /// evictions, instance-seconds and what autoscaling did (flattened into the JSON).
    #[serde(flatten)]
    pub totals: Totals,
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}

/// Builds the report of a run.
pub fn summarize(config: &SimConfig, outcomes: &[Outcome], totals: &Totals) -> Report {
    let slo = config.scheduler.slo;
    let mut r = Report {
        policy: config.scheduler.policy,
        rejection: config.scheduler.rejection,
        prefill_instances: config.scheduler.prefill_costs.len(),
        decode_instances: config.decode_instances,
        requests: outcomes.len(),
        served: 0,
        rejected: 0,
        rejected_ttft: 0,
        rejected_tpot: 0,
        rejected_decode_memory: 0,
        blocks: 0,
        block_hit_ratio: 0.0,
        local_hit_ratio: 0.0,
        pool_hit_ratio: 0.0,
        token_hit_ratio: 0.0,
        ttft_s: Percentiles::default(),
        tpot_s: Percentiles::default(),
        met_ttft: 0,
        met_tpot: 0,
        met_both: 0,
        slo_attainment: 0.0,
        makespan_s: 0.0,
        effective_throughput_rps: 0.0,
        totals: *totals,
    };
    let (mut matched, mut local, mut tokens, mut cached) = (0u64, 0u64, 0u64, 0u64);
    let mut ttft = Vec::with_capacity(outcomes.len());
    let mut tpot = Vec::with_capacity(outcomes.len());
    let first = outcomes
        .iter()
        .map(|o| o.arrival_s)
        .fold(f64::INFINITY, f64::min);
    let mut last = first;
    for o in outcomes {
        match o.rejected {
            Some(reason) => {
                r.rejected += 1;
                match reason {
                    RejectReason::Ttft { .. } => r.rejected_ttft += 1,
                    RejectReason::Tpot { .. } => r.rejected_tpot += 1,
                    RejectReason::DecodeMemory => r.rejected_decode_memory += 1,
                    RejectReason::NoInstance => {}
                }
                last = last.max(o.arrival_s);
            }
            None => {
                r.served += 1;
                r.blocks += u64::from(o.blocks);
                matched += u64::from(o.matched_blocks);
                local += u64::from(o.local_blocks);
                tokens += o.input_tokens;
                cached += o.cached_tokens;
                let (a, b) = (o.ttft_s, o.tpot_s());
                ttft.push(a);
                tpot.push(b);
                let ok_ttft = a <= slo.ttft_s;
                let ok_tpot = b <= slo.tpot_s;
                r.met_ttft += usize::from(ok_ttft);
                r.met_tpot += usize::from(ok_tpot);
                r.met_both += usize::from(ok_ttft && ok_tpot);
                last = last.max(o.finish_s);
            }
        }
    }
    let blocks = r.blocks as f64;
    r.block_hit_ratio = ratio(matched as f64, blocks);
    r.local_hit_ratio = ratio(local as f64, blocks);
    r.pool_hit_ratio = ratio((matched - local) as f64, blocks);
    r.token_hit_ratio = ratio(cached as f64, tokens as f64);
    r.ttft_s = Percentiles::of(&mut ttft);
    r.tpot_s = Percentiles::of(&mut tpot);
    r.slo_attainment = ratio(r.met_both as f64, r.requests as f64);
    if first.is_finite() {
        r.makespan_s = (last - first).max(0.0);
    }
    r.effective_throughput_rps = ratio(r.met_both as f64, r.makespan_s);
    r
}

impl Report {
    /// Human-readable summary.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let pct = |x: f64| x * 100.0;
        let _ = writeln!(
            s,
            "policy {} rejection {} ({} prefill, {} decode instances)",
            self.policy.name(),
            self.rejection.name(),
            self.prefill_instances,
            self.decode_instances
        );
        let _ = writeln!(
            s,
            "requests {}  served {}  rejected {} (ttft {}, tpot {}, decode memory {})",
            self.requests,
            self.served,
            self.rejected,
            self.rejected_ttft,
            self.rejected_tpot,
            self.rejected_decode_memory
        );
        let _ = writeln!(
            s,
            "block hit ratio {:.1}% (local {:.1}%, pool {:.1}%)  token hit ratio {:.1}%",
            pct(self.block_hit_ratio),
            pct(self.local_hit_ratio),
            pct(self.pool_hit_ratio),
            pct(self.token_hit_ratio)
        );
        let _ = writeln!(
            s,
            "TTFT s  p50 {:.3}  p90 {:.3}  p99 {:.3}  mean {:.3}",
            self.ttft_s.p50, self.ttft_s.p90, self.ttft_s.p99, self.ttft_s.mean
        );
        let _ = writeln!(
            s,
            "TPOT s  p50 {:.4}  p90 {:.4}  p99 {:.4}  mean {:.4}",
            self.tpot_s.p50, self.tpot_s.p90, self.tpot_s.p99, self.tpot_s.mean
        );
        let _ = writeln!(
            s,
            "SLO met: ttft {}  tpot {}  both {}  attainment {:.1}%  effective throughput {:.3} req/s",
            self.met_ttft,
            self.met_tpot,
            self.met_both,
            pct(self.slo_attainment),
            self.effective_throughput_rps
        );
        let _ = writeln!(
            s,
            "makespan {:.1} s  prefill busy {:.1} s  decode steps {}  replicated blocks {}  evictions local {} pool {}",
            self.makespan_s,
            self.totals.prefill_busy_s,
            self.totals.decode_steps,
            self.totals.replicated_blocks,
            self.totals.local_evictions,
            self.totals.pool_evictions
        );
        instance_line(
            &mut s,
            "prefill",
            self.totals.prefill_instance_s,
            self.totals.scaling.as_ref(),
            self.prefill_instances,
        );
        instance_line(
            &mut s,
            "decode",
            self.totals.decode_instance_s,
            self.totals.decode_scaling.as_ref(),
            self.decode_instances,
        );
        s
    }
}

/// The line on one role's instance-seconds: what autoscaling did, or the fixed count.
fn instance_line(
    s: &mut String,
    role: &str,
    instance_s: f64,
    autoscale: Option<&ScalingTotals>,
    instances: usize,
) {
    let _ = match autoscale {
        Some(a) => writeln!(
            s,
            "{role} instance-seconds {instance_s:.0}  autoscaled {}..{} instances, {} up and {} down",
            a.fewest, a.most, a.scale_ups, a.scale_downs
        ),
        None => writeln!(
            s,
            "{role} instance-seconds {instance_s:.0}  ({instances} instances throughout)"
        ),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let p = Percentiles::of(&mut v);
        assert_eq!((p.p50, p.p90, p.p99), (50.0, 90.0, 99.0));
        assert_eq!(p.mean, 50.5);
        let mut one = vec![3.0];
        assert_eq!(Percentiles::of(&mut one).p99, 3.0);
        assert_eq!(Percentiles::of(&mut []), Percentiles::default());
    }
}
