//! The output of `kvpool bench conductor`: per target, its figures in every round and their
//! medians over the rounds (latency at one request in flight, the latency it adds over the
//! direct target of the same round, the maximum request rate of the closed loop), and the
//! conductor's figures over sglang-router's. Pure but for [`print_text`] (stdout).

use std::collections::BTreeMap;

use serde::Serialize;

use super::load::Phase;
use crate::mooncake::median;

/// The target with no front door.
pub const DIRECT: &str = "direct";
pub const CONDUCTOR: &str = "conductor";
pub const ROUTER: &str = "sglang_router";

/// One target in one round.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct TargetRound {
    /// `--requests` requests, one in flight.
    pub one_in_flight: Phase,
    /// `--concurrency` requests in flight for `--duration`.
    pub closed_loop: Phase,
}

/// One round: the order the targets ran in and their figures.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Round {
    pub order: Vec<String>,
    pub targets: BTreeMap<String, TargetRound>,
}

/// One target over all rounds: medians, and the rounds themselves.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TargetSummary {
    /// Median over the rounds of the p50 and p99 latencies at one request in flight.
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Median over the rounds of this target's p50 (p99) minus the direct target's in the same
    /// round: the front door's own cost; absent for the direct target.
    pub added_p50_ms: Option<f64>,
    pub added_p99_ms: Option<f64>,
    /// Median over the rounds of the closed loop's successful requests per second.
    pub max_requests_per_second: f64,
    /// Median over the rounds of the closed loop's p50 and p99 latencies.
    pub loaded_p50_ms: f64,
    pub loaded_p99_ms: f64,
    /// Requests of both phases in all rounds, and those that failed.
    pub requests: u64,
    pub failed: u64,
    pub rounds: Vec<TargetRound>,
}

/// The conductor's figures over sglang-router's (the targets of issue 14: `added_p50` at most
/// 1, `max_requests_per_second` above 1).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Ratios {
    pub added_p50: f64,
    pub added_p99: f64,
    pub max_requests_per_second: f64,
}

/// Medians of `name` over `rounds`.
pub fn summarise(rounds: &[Round], name: &str) -> Option<TargetSummary> {
    let mine: Vec<TargetRound> = rounds
        .iter()
        .filter_map(|r| r.targets.get(name).cloned())
        .collect();
    if mine.is_empty() {
        return None;
    }
    let of = |f: &dyn Fn(&TargetRound) -> f64| median(&mine.iter().map(f).collect::<Vec<_>>());
    let added = |f: &dyn Fn(&Phase) -> f64| {
        let v: Vec<f64> = rounds
            .iter()
            .filter_map(|r| {
                let (t, d) = (r.targets.get(name)?, r.targets.get(DIRECT)?);
                Some(f(&t.one_in_flight) - f(&d.one_in_flight))
            })
            .collect();
        (name != DIRECT && !v.is_empty()).then(|| median(&v))
    };
    Some(TargetSummary {
        p50_ms: of(&|t| t.one_in_flight.p50_ms),
        p99_ms: of(&|t| t.one_in_flight.p99_ms),
        added_p50_ms: added(&|p| p.p50_ms),
        added_p99_ms: added(&|p| p.p99_ms),
        max_requests_per_second: of(&|t| t.closed_loop.requests_per_second),
        loaded_p50_ms: of(&|t| t.closed_loop.p50_ms),
        loaded_p99_ms: of(&|t| t.closed_loop.p99_ms),
        requests: mine
            .iter()
            .map(|t| t.one_in_flight.requests + t.closed_loop.requests)
            .sum(),
        failed: mine
            .iter()
            .map(|t| t.one_in_flight.failed + t.closed_loop.failed)
            .sum(),
        rounds: mine,
    })
}

/// The conductor over sglang-router, when both ran.
pub fn ratios(targets: &BTreeMap<String, TargetSummary>) -> Option<Ratios> {
    let (c, r) = (targets.get(CONDUCTOR)?, targets.get(ROUTER)?);
    let over = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    Some(Ratios {
        added_p50: over(c.added_p50_ms?, r.added_p50_ms?),
        added_p99: over(c.added_p99_ms?, r.added_p99_ms?),
        max_requests_per_second: over(c.max_requests_per_second, r.max_requests_per_second),
    })
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub rounds: u32,
    pub requests: u64,
    pub concurrency: usize,
    pub duration_s: f64,
    pub prompt_bytes: usize,
    pub max_tokens: u32,
    pub stream: bool,
    pub prefill: usize,
    pub decode: usize,
    pub agents: usize,
    pub time_scale: f64,
    pub up_command: String,
    /// The order the targets ran in, per round.
    pub orders: Vec<Vec<String>>,
    pub sglang_router_version: Option<String>,
    pub sglang_router_command: Option<String>,
    pub targets: BTreeMap<String, TargetSummary>,
    pub ratio_vs_sglang_router: Option<Ratios>,
    /// Every request of every phase got a complete 200.
    pub all_succeeded: bool,
    /// Issue 14's targets against sglang-router, when both ran.
    pub targets_met: Option<TargetsMet>,
}

/// Issue 14's targets for the conductor against sglang-router in the same run.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub struct TargetsMet {
    /// Its added p50 latency (median over the rounds) is at most the router's.
    pub added_p50_at_most_routers: bool,
    /// Its maximum request rate (median over the rounds) is higher than the router's.
    pub higher_max_requests_per_second: bool,
}

/// Whether the conductor met the targets, when both front doors ran.
pub fn targets_met(targets: &BTreeMap<String, TargetSummary>) -> Option<TargetsMet> {
    let (c, s) = (targets.get(CONDUCTOR)?, targets.get(ROUTER)?);
    Some(TargetsMet {
        added_p50_at_most_routers: c.added_p50_ms? <= s.added_p50_ms?,
        higher_max_requests_per_second: c.max_requests_per_second > s.max_requests_per_second,
    })
}

/// The report for people.
pub fn print_text(r: &Report) {
    println!(
        "{} round(s): {} requests at one in flight, then {} in flight for {:.1} s, per target; \
         prompt {} B, {} tokens out, {}",
        r.rounds,
        r.requests,
        r.concurrency,
        r.duration_s,
        r.prompt_bytes,
        r.max_tokens,
        if r.stream { "streamed" } else { "not streamed" }
    );
    println!(
        "{:<14} {:>9} {:>9} {:>11} {:>11} {:>10} {:>13}",
        "target", "p50 ms", "p99 ms", "+p50 ms", "+p99 ms", "max req/s", "failed/total"
    );
    let opt = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.3}"));
    for (name, t) in &r.targets {
        println!(
            "{:<14} {:>9.3} {:>9.3} {:>11} {:>11} {:>10.0} {:>13}",
            name,
            t.p50_ms,
            t.p99_ms,
            opt(t.added_p50_ms),
            opt(t.added_p99_ms),
            t.max_requests_per_second,
            format!("{}/{}", t.failed, t.requests)
        );
    }
    if let Some(q) = &r.ratio_vs_sglang_router {
        println!(
            "conductor / sglang-router: added p50 {:.2}, added p99 {:.2}, max req/s {:.2}",
            q.added_p50, q.added_p99, q.max_requests_per_second
        );
    }
    if let Some(t) = &r.targets_met {
        println!(
            "target (added p50 <= router's): {}; target (higher max req/s): {}",
            t.added_p50_at_most_routers, t.higher_max_requests_per_second
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn phase(p50: f64, p99: f64, rps: f64) -> Phase {
        Phase {
            requests: 10,
            ok: 10,
            p50_ms: p50,
            p99_ms: p99,
            requests_per_second: rps,
            ..Phase::default()
        }
    }

    fn round(direct: f64, conductor: f64, router: f64) -> Round {
        let t = |p50: f64, rps: f64| TargetRound {
            one_in_flight: phase(p50, 2.0 * p50, 0.0),
            closed_loop: phase(0.0, 0.0, rps),
        };
        Round {
            order: vec![DIRECT.into(), CONDUCTOR.into(), ROUTER.into()],
            targets: [
                (DIRECT.to_owned(), t(direct, 1000.0)),
                (CONDUCTOR.to_owned(), t(conductor, 900.0)),
                (ROUTER.to_owned(), t(router, 600.0)),
            ]
            .into(),
        }
    }

    #[test]
    fn added_latency_is_taken_against_the_same_rounds_direct_target_then_the_median() {
        // Round 2's direct figure is slow: its conductor still added only 0.1 ms.
        let rounds = [
            round(1.0, 1.2, 1.5),
            round(3.0, 3.1, 3.6),
            round(1.0, 1.3, 1.4),
        ];
        let c = summarise(&rounds, CONDUCTOR).unwrap();
        assert!((c.added_p50_ms.unwrap() - 0.2).abs() < 1e-9);
        assert!((c.added_p99_ms.unwrap() - 0.4).abs() < 1e-9);
        assert_eq!(c.p50_ms, 1.3);
        assert_eq!(c.max_requests_per_second, 900.0);
        assert_eq!((c.requests, c.failed), (60, 0));
        assert_eq!(summarise(&rounds, DIRECT).unwrap().added_p50_ms, None);
        assert_eq!(summarise(&rounds, "absent"), None);
    }

    #[test]
    fn the_ratios_are_the_conductors_figures_over_the_routers() {
        let rounds = [round(1.0, 1.2, 1.5)];
        let targets: BTreeMap<String, TargetSummary> = [CONDUCTOR, ROUTER, DIRECT]
            .into_iter()
            .map(|n| (n.to_owned(), summarise(&rounds, n).unwrap()))
            .collect();
        let q = ratios(&targets).unwrap();
        assert!((q.added_p50 - 0.2 / 0.5).abs() < 1e-9);
        assert!((q.max_requests_per_second - 1.5).abs() < 1e-9);
        assert_eq!(
            targets_met(&targets),
            Some(TargetsMet {
                added_p50_at_most_routers: true,
                higher_max_requests_per_second: true
            })
        );
        let without: BTreeMap<_, _> = targets.into_iter().filter(|(n, _)| n != ROUTER).collect();
        assert_eq!(ratios(&without), None);
        assert_eq!(targets_met(&without), None);
    }
}
