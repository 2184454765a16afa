//! Engine tests: hand-computed timelines, decode memory, at-decode rejection and autoscaling.
use std::num::NonZeroU32;

use super::*;
use crate::autoscale::Signal;
use crate::sched::{DecodeCost, HotConfig, Policy, PrefillCost, Rejection, SchedulerConfig, Slo};
use crate::sim::scaling::AutoscaleConfig;

fn config(decode_capacity: u64) -> SimConfig {
    SimConfig {
        scheduler: SchedulerConfig {
            policy: Policy::Conductor,
            rejection: Rejection::None,
            slo: Slo {
                ttft_s: 10.0,
                tpot_s: 1.0,
            },
            block_size: NonZeroU32::new(10).unwrap(),
            bytes_per_token: 1,
            // Transfers take no time (1e-307 s).
            pool_bandwidth_bps: f64::MAX,
            kv_bandwidth_bps: f64::MAX,
            // 0.1 s per token, nothing else
            prefill_costs: vec![
                PrefillCost {
                    fixed_s: 0.0,
                    linear_s: 0.1,
                    quadratic_s: 0.0,
                };
                1
            ],
            // 1 s per step
            decode_cost: DecodeCost {
                fixed_s: 1.0,
                per_seq_s: 0.0,
                per_ctx_token_s: 0.0,
            },
            handoff: Default::default(),
            decode_kv_capacity_tokens: decode_capacity,
            hot: HotConfig {
                threshold: 0,
                fanout: 0,
            },
            seed: 1,
        },
        decode_instances: 1,
        local_cache_blocks: UNLIMITED,
        pool_blocks: UNLIMITED,
        time_scale: 1.0,
        autoscale: None,
        autoscale_decode: None,
    }
}

fn close(a: f64, b: f64) {
    assert!((a - b).abs() < 1e-6, "{a} != {b}");
}

fn rec(ts: u64, input: u64, output: u32, ids: &[u64]) -> TraceRecord {
    TraceRecord {
        timestamp_ms: ts,
        input_length: input,
        output_length: output,
        hash_ids: ids.to_vec(),
    }
}

/// A load one instance cannot carry (a 2 s prefill every second) then a quiet tail:
/// autoscaling adds instances while it lasts and gives them back after, and meets the SLO
/// where the one fixed instance does not, with fewer instance-seconds than four fixed.
#[test]
fn autoscaling_follows_the_load_and_saves_instance_seconds() {
    let mut records: Vec<TraceRecord> = (0..240u64)
        .map(|i| rec(i * 1000, 20, 2, &[1_000 + 2 * i, 1_001 + 2 * i]))
        .collect();
    records.extend((0..12u64).map(|i| rec(300_000 + i * 60_000, 20, 2, &[9_000 + i])));
    let mut fixed = config(u64::MAX);
    fixed.scheduler.slo.ttft_s = 8.0;
    fixed.scheduler.slo.tpot_s = 100.0;
    let mut four = fixed.clone();
    four.scheduler.prefill_costs = vec![fixed.scheduler.prefill_costs[0]; 4];
    let mut scaled = four.clone();
    scaled.autoscale = Some(one_to_four());
    let [one, four, auto] = simulate_each(&records, [&fixed, &four, &scaled]);
    let a = auto.totals.scaling.expect("autoscaled");
    assert!(a.most > 1 && a.scale_ups >= 1, "{a:?}");
    assert!(a.scale_downs >= 1 && a.fewest == 1, "{a:?}");
    assert!(
        auto.slo_attainment > one.slo_attainment + 0.3,
        "{} vs {}",
        auto.slo_attainment,
        one.slo_attainment
    );
    assert!(
        auto.totals.prefill_instance_s < 0.7 * four.totals.prefill_instance_s,
        "{} vs {}",
        auto.totals.prefill_instance_s,
        four.totals.prefill_instance_s
    );
    assert!(four.totals.scaling.is_none());
    close(one.totals.prefill_instance_s, one.makespan_s);
}

/// A decode load one instance cannot carry (two 100-token requests a second, each step
/// 10 ms plus 10 ms per running request: one instance's batch grows without bound; three
/// hold it at a 40 ms TPOT, under the 100 ms SLO) then a quiet tail: decode autoscaling adds instances while it lasts, gives them back after, meets
/// the TPOT SLO where one fixed instance does not, and costs fewer decode instance-seconds
/// than four fixed ones.
#[test]
fn decode_autoscaling_follows_the_load_and_saves_instance_seconds() {
    let mut records: Vec<TraceRecord> = (0..1200u64)
        .map(|i| rec(i * 500, 1, 101, &[10_000 + i]))
        .collect();
    records.extend((0..20u64).map(|i| rec(600_000 + i * 60_000, 1, 101, &[90_000 + i])));
    let mut one = config(u64::MAX);
    one.scheduler.slo = crate::sched::Slo {
        ttft_s: 100.0,
        tpot_s: 0.1,
    };
    one.scheduler.prefill_costs[0].linear_s = 0.01;
    one.scheduler.decode_cost = crate::sched::DecodeCost {
        fixed_s: 0.01,
        per_seq_s: 0.01,
        per_ctx_token_s: 0.0,
    };
    let mut four = one.clone();
    four.decode_instances = 4;
    let mut scaled = four.clone();
    scaled.autoscale_decode = Some(one_to_four());
    let [one, four, auto] = simulate_each(&records, [&one, &four, &scaled]);
    let a = auto.totals.decode_scaling.expect("decode autoscaled");
    assert!(a.most == 4 && a.scale_ups >= 1, "{a:?}");
    assert!(a.scale_downs >= 1 && a.fewest == 1, "{a:?}");
    assert!(auto.totals.scaling.is_none() && four.totals.decode_scaling.is_none());
    let tpot_share = |r: &Report| r.met_tpot as f64 / r.requests as f64;
    assert!(
        tpot_share(&auto) > tpot_share(&one) + 0.3,
        "{} vs {}",
        tpot_share(&auto),
        tpot_share(&one)
    );
    assert!(
        auto.totals.decode_instance_s < 0.8 * four.totals.decode_instance_s,
        "{} vs {}",
        auto.totals.decode_instance_s,
        four.totals.decode_instance_s
    );
    close(four.totals.decode_instance_s, 4.0 * four.makespan_s);
    // Prefill is untouched by decode scaling.
    close(auto.totals.prefill_instance_s, auto.makespan_s);
}

#[test]
fn hand_computed_timeline() {
    // A: 20 tokens at 0 s -> prefill 2 s (TTFT 2), decode 3 tokens at 1 s/step: 2..5 s.
    // B: same prefix + 10 more at 1 s -> waits for A's prefill until 2 s, prefills only
    //    its 10 new tokens (1 s): TTFT 2 s, decodes 1 token 3..4 s alongside A.
    let records = [rec(0, 20, 4, &[1, 2]), rec(1000, 30, 2, &[1, 2, 3])];
    let (o, totals) = run(&records, &config(1000)).unwrap();
    assert_eq!(
        (o[0].ttft_s, o[0].decode_arrival_s, o[0].finish_s),
        (2.0, 2.0, 5.0)
    );
    assert_eq!(o[0].tpot_s(), 1.0);
    assert_eq!((o[1].matched_blocks, o[1].cached_tokens), (2, 20));
    // B reaches decode at 3 s, just as A's step ends, and joins the next step.
    assert_eq!((o[1].ttft_s, o[1].finish_s), (2.0, 4.0));
    assert_eq!(totals.prefill_busy_s, 3.0);
}

#[test]
fn decode_memory_makes_requests_wait_in_order() {
    // Memory for 25 tokens: B (20 tokens) must wait until A (20 tokens) has finished.
    let records = [rec(0, 20, 3, &[1, 2]), rec(0, 20, 3, &[5, 6])];
    let (o, _) = run(&records, &config(25)).unwrap();
    // A: prefill 0..2 s, decode 2 tokens 2..4 s. B: prefill 2..4 s, joins at 4 s, 4..6 s.
    close(o[0].finish_s, 4.0);
    close(o[1].decode_arrival_s, 4.0);
    close(o[1].finish_s, 6.0);
    // Here prefill serialises them anyway; now let B arrive while A decodes.
    let records = [rec(0, 20, 5, &[1, 2]), rec(0, 1, 3, &[9])];
    let (o, _) = run(&records, &config(20)).unwrap();
    // A decodes 4 tokens 2..6 s holding all 20 tokens (+ growth); B (prefill 0.1 s) arrives
    // at 2.1 s and waits for A to leave at 6 s, then takes 2 steps: 6..8 s.
    close(o[0].finish_s, 6.0);
    close(o[1].finish_s, 8.0);
    close(o[1].tpot_s(), (8.0 - 2.1) / 2.0);
}

#[test]
fn at_decode_rejection_refuses_after_the_prefill_was_spent() {
    // As in the second case above, B arrives at decode at 2.1 s while A holds all memory:
    // with at-decode rejection the decode instance refuses B then, after its 0.1 s of
    // prefill; A is served as before. Early rejection would have refused B at arrival (0 s)
    // only if decode looked full then, which it did not (A was still in prefill).
    let records = [rec(0, 20, 5, &[1, 2]), rec(0, 1, 3, &[9])];
    let mut cfg = config(20);
    cfg.scheduler.rejection = Rejection::AtDecode;
    let (o, totals) = run(&records, &cfg).unwrap();
    close(o[0].finish_s, 6.0);
    assert_eq!(o[0].rejected, None);
    assert_eq!(o[1].rejected, Some(RejectReason::DecodeMemory));
    close(o[1].decode_arrival_s, 2.1);
    // Both prefills were spent: 2 s + 0.1 s.
    close(totals.prefill_busy_s, 2.1);
    let mut early = config(20);
    early.scheduler.rejection = Rejection::Early;
    let (o, _) = run(&records, &early).unwrap();
    assert_eq!(o[1].rejected, None);
    // An idle decode instance takes anything, even at-decode.
    let (o, _) = run(&[rec(0, 30, 3, &[1, 2, 3])], &cfg).unwrap();
    assert_eq!(o[0].rejected, None);
}

#[test]
fn empty_prompts_and_single_token_outputs_are_served() {
    let records = [rec(0, 0, 0, &[]), rec(0, 5, 1, &[4])];
    let (o, _) = run(&records, &config(100)).unwrap();
    assert!(
        o.iter()
            .all(|x| x.rejected.is_none() && x.finish_s > x.arrival_s)
    );
    assert_eq!(o[0].decode_tokens, 1);
    let mut bad = config(100);
    bad.time_scale = 0.0;
    assert_eq!(run(&records, &bad).unwrap_err().category(), "time_scale");
}

/// Autoscaling between one and four instances on the predicted latency, with a 5 s start-up.
fn one_to_four() -> AutoscaleConfig {
    AutoscaleConfig {
        startup_s: 5.0,
        ..AutoscaleConfig::new(1, 4, Signal::PredictedLatency)
    }
}

/// The reports of `records` under each configuration.
fn simulate_each<const N: usize>(records: &[TraceRecord], configs: [&SimConfig; N]) -> [Report; N] {
    configs.map(|c| simulate(records, c).expect("simulate"))
}
