//! Unit tests of the scheduling policies: prefill and decode choice, early and predicted
//! rejection, hot-block replication and configuration errors.

use std::num::NonZeroU32;

use super::*;
use crate::sched::blocks::BlockKey;
use crate::sched::cost::{DecodeCost, HandoffCost, PrefillCost};

fn config(policy: Policy, rejection: Rejection, prefill: usize) -> SchedulerConfig {
    SchedulerConfig {
        policy,
        rejection,
        slo: Slo {
            ttft_s: 10.0,
            tpot_s: 0.1,
        },
        block_size: NonZeroU32::new(100).unwrap(),
        bytes_per_token: 1000,
        // 1e6 B/s: one 100-token block of 1000 B/token = 1e5 B takes 0.1 s
        pool_bandwidth_bps: 1.0e6,
        kv_bandwidth_bps: 1.0e7,
        // prefill: 1 ms per token, no fixed or quadratic term
        prefill_costs: vec![
            PrefillCost {
                fixed_s: 0.0,
                linear_s: 0.001,
                quadratic_s: 0.0,
            };
            prefill
        ],
        // decode step: 10 ms + 10 ms per sequence + 1 us per context token
        decode_cost: DecodeCost {
            fixed_s: 0.01,
            per_seq_s: 0.01,
            per_ctx_token_s: 1e-6,
        },
        handoff: Default::default(),
        decode_kv_capacity_tokens: 10_000,
        hot: HotConfig {
            threshold: 0,
            fanout: 0,
        },
        seed: 7,
    }
}

fn req(keys: &[BlockKey], input: u64) -> Request<'_> {
    Request {
        keys,
        input_tokens: input,
        output_tokens: 10,
    }
}

/// A request on a decode instance (request id 0).
fn member(context_tokens: u64, remaining_tokens: u32, joins_at_s: f64) -> DecodeMember {
    DecodeMember {
        request: 0,
        context_tokens,
        remaining_tokens,
        joins_at_s,
    }
}

/// A decode instance running `running`, with nothing assigned that has not arrived.
fn running(running: Vec<DecodeMember>) -> DecodeLoad {
    DecodeLoad {
        running,
        pending: vec![],
    }
}

/// `s`'s decision at 0 s for a prompt of `input` tokens and no cached blocks, with one idle
/// prefill instance and one decode instance loaded as `decode`.
fn decide_alone(s: &mut Scheduler, idx: &PrefixIndex, input: u64, decode: DecodeLoad) -> Decision {
    s.decide(
        0.0,
        &req(&[], input),
        idx,
        &[PrefillLoad::default()],
        &[decode],
    )
}

/// Prefill instances busy until the given times.
/// Blocks 1 to 4 of [`index`], 400 tokens.
fn four_block_request() -> Request<'static> {
    const KEYS: [BlockKey; 4] = [1, 2, 3, 4];
    req(&KEYS, 400)
}

fn free_at(times: &[f64]) -> Vec<PrefillLoad> {
    times
        .iter()
        .map(|&free_at_s| PrefillLoad { free_at_s })
        .collect()
}

fn accept(d: Decision) -> Placement {
    match d {
        Decision::Accept(p) => p,
        Decision::Reject(r) => panic!("rejected: {r:?}"),
    }
}

/// Index for 3 instances: instance 0 holds blocks 1,2 locally, instance 1 holds block 1,
/// the pool holds 1,2,3.
fn index() -> PrefixIndex {
    let mut idx = PrefixIndex::new(3).unwrap();
    idx.add_local(1, 0);
    idx.add_local(2, 0);
    idx.add_local(1, 1);
    for k in [1, 2, 3] {
        idx.add_pool_replica(k);
    }
    idx
}

#[test]
fn conductor_minimises_estimated_ttft() {
    let mut s = Scheduler::new(config(Policy::Conductor, Rejection::None, 3), 1).unwrap();
    let idx = index();
    let r = four_block_request();
    // Every instance matches 3 blocks (300 tokens) through the pool; 100 tokens to prefill
    // = 0.1 s. Fetch: instance 0 needs block 3 (0.1 s), instance 1 blocks 2,3 (0.2 s),
    // instance 2 all three (0.3 s). Queues: 0.5 s, 0 s, 0 s.
    // TTFT: 0 -> 0.5+0.1+0.1 = 0.7; 1 -> 0+0.2+0.1 = 0.3; 2 -> 0+0.3+0.1 = 0.4.
    let loads = free_at(&[100.5, 50.0, 0.0]);
    let p = accept(s.decide(100.0, &r, &idx, &loads, &[DecodeLoad::default()]));
    assert_eq!(p.prefill, 1);
    assert_eq!(
        p.prefix,
        PrefixMatch {
            matched_blocks: 3,
            local_blocks: 1
        }
    );
    assert_eq!(p.cached_tokens, 300);
    assert!((p.ttft.fetch_s - 0.2).abs() < 1e-12);
    assert!((p.ttft.prefill_s - 0.1).abs() < 1e-12);
    assert_eq!(p.ttft.queue_s, 0.0);
    // KV transfer: 400 tokens * 1000 B / 1e7 B/s = 0.04 s
    assert!((p.kv_transfer_s - 0.04).abs() < 1e-12);
    // Decode step with the request alone: 0.01 + 0.01 + 400e-6
    assert!((p.tpot_s - 0.0204).abs() < 1e-12);
}

#[test]
fn local_only_ignores_the_pool() {
    let mut s = Scheduler::new(config(Policy::LocalOnly, Rejection::None, 3), 1).unwrap();
    let idx = index();
    let r = four_block_request();
    let loads = [PrefillLoad::default(); 3];
    // Local prefixes: 2, 1, 0 blocks -> prefill 0.2, 0.3, 0.4 s; no fetch.
    let p = accept(s.decide(0.0, &r, &idx, &loads, &[DecodeLoad::default()]));
    assert_eq!(p.prefill, 0);
    assert_eq!(p.ttft.fetch_s, 0.0);
    assert!((p.ttft.prefill_s - 0.2).abs() < 1e-12);
}

#[test]
fn baselines_choose_as_defined() {
    let idx = index();
    let r = four_block_request();
    let loads = free_at(&[3.0, 1.0, 2.0]);
    let dl = [DecodeLoad::default(), DecodeLoad::default()];
    let mut ll = Scheduler::new(config(Policy::LeastLoad, Rejection::None, 3), 2).unwrap();
    assert_eq!(accept(ll.decide(0.0, &r, &idx, &loads, &dl)).prefill, 1);
    let mut ca = Scheduler::new(config(Policy::CacheAware, Rejection::None, 3), 2).unwrap();
    // Instance 0 has the most local blocks (2) despite the longest queue.
    assert_eq!(accept(ca.decide(0.0, &r, &idx, &loads, &dl)).prefill, 0);
    let mut rr = Scheduler::new(config(Policy::RoundRobin, Rejection::None, 3), 2).unwrap();
    let seq: Vec<(usize, usize)> = (0..4)
        .map(|_| {
            let p = accept(rr.decide(0.0, &r, &idx, &loads, &dl));
            (p.prefill, p.decode)
        })
        .collect();
    assert_eq!(seq, vec![(0, 0), (1, 1), (2, 0), (0, 1)]);
    let mut rnd = Scheduler::new(config(Policy::Random, Rejection::None, 3), 2).unwrap();
    let mut seen = [0usize; 3];
    for _ in 0..300 {
        seen[accept(rnd.decide(0.0, &r, &idx, &loads, &dl)).prefill] += 1;
    }
    assert!(seen.iter().all(|&c| c > 50), "{seen:?}");
}

#[test]
fn decode_goes_to_the_lightest_instance_with_room() {
    let mut s = Scheduler::new(config(Policy::Conductor, Rejection::None, 1), 3).unwrap();
    let idx = PrefixIndex::new(1).unwrap();
    let m = |ctx: u64| member(ctx, 100, 0.0);
    let decode = [
        // 2 sequences, 2000 tokens: step after adding 500 = 0.01+0.03+0.0025 = 0.0425
        running(vec![m(1000), m(1000)]),
        // 1 sequence but 9600 tokens: the request (500) does not fit in 10_000
        running(vec![m(9600)]),
        // 1 sequence, 3000 tokens: 0.01+0.02+0.0035 = 0.0335
        running(vec![m(3000)]),
    ];
    let p = accept(s.decide(
        0.0,
        &req(&[], 500),
        &idx,
        &[PrefillLoad::default()],
        &decode,
    ));
    assert_eq!(p.decode, 2);
    assert!((p.tpot_s - 0.0335).abs() < 1e-12);
}

#[test]
fn early_rejection_on_ttft_tpot_and_memory() {
    let idx = PrefixIndex::new(1).unwrap();
    let mut s = Scheduler::new(config(Policy::Conductor, Rejection::Early, 1), 1).unwrap();
    // 11_000 tokens at 1 ms each = 11 s > 10 s SLO.
    let d = decide_alone(&mut s, &idx, 11_000, DecodeLoad::default());
    assert_eq!(d, Decision::Reject(RejectReason::Ttft { estimate_s: 11.0 }));
    // The same request with no rejection is accepted.
    let mut none = Scheduler::new(config(Policy::Conductor, Rejection::None, 1), 1).unwrap();
    assert!(matches!(
        decide_alone(&mut none, &idx, 11_000, DecodeLoad::default()),
        Decision::Accept(_)
    ));
    // Decode: 9 running sequences of 100 tokens; adding one: 0.01 + 0.1 + 0.001 = 0.111 s.
    let busy = running(vec![member(100, 1000, 0.0); 9]);
    match decide_alone(&mut s, &idx, 100, busy) {
        Decision::Reject(RejectReason::Tpot { estimate_s }) => {
            assert!((estimate_s - 0.111).abs() < 1e-12)
        }
        other => panic!("{other:?}"),
    }
    let full = running(vec![member(9_950, 10, 0.0)]);
    assert_eq!(
        decide_alone(&mut s, &idx, 100, full),
        Decision::Reject(RejectReason::DecodeMemory)
    );
}

#[test]
fn the_hand_off_is_part_of_the_estimate_and_of_early_rejection() {
    let idx = PrefixIndex::new(1).unwrap();
    let mut s = Scheduler::new(config(Policy::Conductor, Rejection::Early, 1), 1).unwrap();
    // 9,000 tokens at 1 ms: 9 s of prefill, within the 10 s SLO.
    let p = accept(decide_alone(&mut s, &idx, 9_000, DecodeLoad::default()));
    assert_eq!(p.ttft.handoff_s, 0.0);
    // A hand-off of 0.5 s + 0.1 ms per prompt token adds 1.4 s: 10.4 s misses it.
    s.set_handoff_cost(HandoffCost {
        fixed_s: 0.5,
        per_token_s: 1e-4,
    });
    match decide_alone(&mut s, &idx, 9_000, DecodeLoad::default()) {
        Decision::Reject(RejectReason::Ttft { estimate_s }) => {
            assert!((estimate_s - 10.4).abs() < 1e-9, "{estimate_s}")
        }
        other => panic!("{other:?}"),
    }
    let p = accept(decide_alone(&mut s, &idx, 1_000, DecodeLoad::default()));
    assert!((p.ttft.handoff_s - 0.6).abs() < 1e-12, "{:?}", p.ttft);
    assert!((p.ttft.total_s() - 1.6).abs() < 1e-12, "{:?}", p.ttft);
    // A model with a negative or non-finite term is ignored; a configured one is refused.
    s.set_handoff_cost(HandoffCost {
        fixed_s: -1.0,
        per_token_s: 0.0,
    });
    let p = accept(decide_alone(&mut s, &idx, 1_000, DecodeLoad::default()));
    assert!((p.ttft.handoff_s - 0.6).abs() < 1e-12);
    let mut c = config(Policy::Conductor, Rejection::None, 1);
    c.handoff.per_token_s = f64::NAN;
    let err = Scheduler::new(c, 1).unwrap_err();
    assert!(
        err.to_string().contains("handoff seconds per token"),
        "{err}"
    );
}

#[test]
fn refusals_that_an_idle_pool_would_repeat_are_told_apart_from_load() {
    let idx = PrefixIndex::new(2).unwrap();
    let s = Scheduler::new(config(Policy::Conductor, Rejection::Predicted, 2), 1).unwrap();
    // 11_000 tokens at 1 ms each: 11 s of prefill even with no queue, over the 10 s SLO.
    assert_eq!(
        s.refused_when_idle(5.0, &req(&[], 11_000), &idx, 2),
        Some(RejectReason::Ttft { estimate_s: 11.0 })
    );
    // 5_000 tokens: 5 s on an idle instance; a refusal of it was the queue's doing.
    assert_eq!(s.refused_when_idle(5.0, &req(&[], 5_000), &idx, 2), None);
    // More prompt than a decode instance's 10_000-token KV memory, with a lenient TTFT SLO.
    let mut lenient = config(Policy::Conductor, Rejection::Early, 1);
    lenient.slo.ttft_s = 100.0;
    let s = Scheduler::new(lenient.clone(), 1).unwrap();
    assert_eq!(
        s.refused_when_idle(0.0, &req(&[], 10_001), &idx, 1),
        Some(RejectReason::DecodeMemory)
    );
    assert_eq!(s.refused_when_idle(0.0, &req(&[], 10_000), &idx, 1), None);
    // A decode step alone: 0.01 + 0.01 + 1e-6 * tokens; over 0.1 s past 80_000 tokens.
    lenient.decode_kv_capacity_tokens = 1_000_000;
    lenient.slo.ttft_s = 1000.0;
    let s = Scheduler::new(lenient.clone(), 1).unwrap();
    assert!(matches!(
        s.refused_when_idle(0.0, &req(&[], 90_000), &idx, 1),
        Some(RejectReason::Tpot { .. })
    ));
    // Without early rejection nothing is refused, idle or not.
    lenient.rejection = Rejection::None;
    let s = Scheduler::new(lenient, 1).unwrap();
    assert_eq!(s.refused_when_idle(0.0, &req(&[], 90_000), &idx, 1), None);
}

#[test]
fn prediction_sees_finishing_and_arriving_requests() {
    let cost = DecodeCost {
        fixed_s: 0.01,
        per_seq_s: 0.01,
        per_ctx_token_s: 0.0,
    };
    let m = |remaining: u32, joins: f64| member(100, remaining, joins);
    let load = DecodeLoad {
        // step now with 2 running = 0.03 s; in 1.5 s = 50 steps
        running: vec![m(10, 0.0), m(1000, 0.0)],
        // one still in prefill arriving at 1.0 s, one at 5.0 s
        pending: vec![m(10, 1.0), m(10, 5.0)],
    };
    assert_eq!(
        load.current(0.0),
        DecodeView {
            batch: 2,
            context_tokens: 200
        }
    );
    // At 1.5 s: the 10-token request is done, the 1000-token one has 150 tokens of context,
    // the request arriving at 1.0 s has joined, the one arriving at 5.0 s has not.
    assert_eq!(
        load.predicted(0.0, 1.5, &cost),
        DecodeView {
            batch: 2,
            context_tokens: 250
        }
    );
}

#[test]
fn predicted_admission_waits_for_enough_departures() {
    let cost = DecodeCost {
        fixed_s: 0.01,
        per_seq_s: 0.01,
        per_ctx_token_s: 0.0,
    };
    // Step with C joined (3 sequences) = 0.04 s. A finishes at 100 x 0.04 = 4.0 s, B at
    // 2.0 s; C joins at 0.5 s and finishes at 0.5 + 10 x 0.04 = 0.9 s.
    let load = DecodeLoad {
        running: vec![member(4000, 100, 0.0), member(3000, 50, 0.0)],
        pending: vec![member(2000, 10, 0.5)],
    };
    let mut scratch = Vec::new();
    // Memory 9_500. C joins at 0.5 s next to A and B (9000 tokens). The request (3000)
    // arrives at 0.75 s: C leaving at 0.9 s is not enough (10_000), B leaving at 2.0 s is
    // (7000): it starts at 2.0 s, next to A alone, after waiting 1.25 s.
    let (v, wait) = load
        .predicted_admission(0.0, 0.75, &cost, 9_500, 3000, &mut scratch)
        .unwrap();
    assert_eq!(
        v,
        DecodeView {
            batch: 1,
            context_tokens: 4000
        }
    );
    assert!((wait - 1.25).abs() < 1e-9, "{wait}");
    // With 10_000 tokens C's departure at 0.9 s is enough: a 0.15 s wait next to A and B.
    let (v, wait) = load
        .predicted_admission(0.0, 0.75, &cost, 10_000, 3000, &mut scratch)
        .unwrap();
    assert_eq!(v.batch, 2);
    assert!((wait - 0.15).abs() < 1e-9, "{wait}");
    // Room right away: no wait, everyone still there.
    let (v, wait) = load
        .predicted_admission(0.0, 0.75, &cost, 20_000, 3000, &mut scratch)
        .unwrap();
    assert_eq!((v.batch, wait), (3, 0.0));
    // Larger than the whole instance: never.
    assert_eq!(
        load.predicted_admission(0.0, 0.75, &cost, 2_000, 3000, &mut scratch),
        None
    );
}

#[test]
fn predicted_rejection_admits_what_current_load_rejects() {
    // Decode is full now (9 sequences), but all of them finish within 1 s, before the
    // request reaches decode (prefill of 5000 tokens takes 5 s).
    let idx = PrefixIndex::new(1).unwrap();
    let busy = running(vec![member(100, 5, 0.0); 9]);
    let r = req(&[], 5000);
    let pl = [PrefillLoad::default()];
    let mut early = Scheduler::new(config(Policy::Conductor, Rejection::Early, 1), 1).unwrap();
    assert!(matches!(
        early.decide(0.0, &r, &idx, &pl, std::slice::from_ref(&busy)),
        Decision::Reject(RejectReason::Tpot { .. })
    ));
    let mut pred = Scheduler::new(config(Policy::Conductor, Rejection::Predicted, 1), 1).unwrap();
    let p = accept(pred.decide(0.0, &r, &idx, &pl, std::slice::from_ref(&busy)));
    // Alone at decode: 0.01 + 0.01 + 5000e-6
    assert!((p.tpot_s - 0.025).abs() < 1e-12);
}

#[test]
fn prediction_rejects_a_burst_that_current_load_does_not_see() {
    // Decode is idle now, but nine requests of 1000 tokens already sent to prefill arrive
    // at 0.5 s, before this one (prefill of 1500 tokens: 1.5 s), and run for 100 tokens.
    let idx = PrefixIndex::new(1).unwrap();
    let burst = DecodeLoad {
        running: vec![],
        pending: vec![member(1000, 100, 0.5); 9],
    };
    let r = req(&[], 1500);
    let pl = [PrefillLoad::default()];
    let mut early = Scheduler::new(config(Policy::Conductor, Rejection::Early, 1), 1).unwrap();
    let p = accept(early.decide(0.0, &r, &idx, &pl, std::slice::from_ref(&burst)));
    // Alone, as it looks now: 0.01 + 0.01 + 1500e-6.
    assert!((p.tpot_s - 0.0215).abs() < 1e-12);
    let mut pred = Scheduler::new(config(Policy::Conductor, Rejection::Predicted, 1), 1).unwrap();
    // 9000 + 1500 tokens exceed the 10_000-token memory when it arrives.
    assert_eq!(
        pred.decide(0.0, &r, &idx, &pl, std::slice::from_ref(&burst)),
        Decision::Reject(RejectReason::DecodeMemory)
    );
}

#[test]
fn prediction_favours_prompts_that_reach_decode_later() {
    // Why prediction rejects more on memory-bound traces: decode memory (10_000 tokens) is
    // nearly full now and frees at 1.74 s (one request of 9_000 tokens with 60 steps left
    // at 0.01 + 0.01 + 0.009 = 0.029 s). A shorter prompt (1_500 tokens: prefill 1.5 s +
    // transfer 0.15 s) would arrive at 1.65 s, before the memory frees: prediction rejects
    // it. A long prompt (3_000 tokens) arrives at 3.3 s, after: prediction admits it. Judging on the load now treats both alike (both rejected), so
    // prediction turns the admitted mix toward long prompts, which hold more memory each.
    let idx = PrefixIndex::new(1).unwrap();
    let full = running(vec![member(9_000, 60, 0.0)]);
    let pl = [PrefillLoad::default()];
    let (short, long) = (req(&[], 1_500), req(&[], 3_000));
    let mut pred = Scheduler::new(config(Policy::Conductor, Rejection::Predicted, 1), 1).unwrap();
    assert_eq!(
        pred.decide(0.0, &short, &idx, &pl, std::slice::from_ref(&full)),
        Decision::Reject(RejectReason::DecodeMemory)
    );
    let p = accept(pred.decide(0.0, &long, &idx, &pl, std::slice::from_ref(&full)));
    // Alone at decode once the running request has left: 0.01 + 0.01 + 3000e-6.
    assert!((p.tpot_s - 0.023).abs() < 1e-12, "{}", p.tpot_s);
    let mut early = Scheduler::new(config(Policy::Conductor, Rejection::Early, 1), 1).unwrap();
    for r in [&short, &long] {
        assert_eq!(
            early.decide(0.0, r, &idx, &pl, std::slice::from_ref(&full)),
            Decision::Reject(RejectReason::DecodeMemory)
        );
    }
}

#[test]
fn hot_prefix_is_replicated_to_least_loaded_non_holders() {
    let mut cfg = config(Policy::Conductor, Rejection::None, 4);
    cfg.hot = HotConfig {
        threshold: 2,
        fanout: 2,
    };
    let s = Scheduler::new(cfg, 1).unwrap();
    let mut idx = PrefixIndex::new(4).unwrap();
    for k in [1, 2] {
        idx.add_pool_replica(k);
    }
    idx.add_local(1, 3);
    let keys = [1, 2, 9];
    let placement = Placement {
        prefill: 0,
        decode: 0,
        prefix: PrefixMatch {
            matched_blocks: 2,
            local_blocks: 0,
        },
        cached_tokens: 200,
        ttft: TtftEstimate::default(),
        kv_transfer_s: 0.0,
        tpot_s: 0.0,
    };
    let loads = free_at(&[0.0, 5.0, 1.0, 0.0]);
    // First hit: below the threshold.
    assert_eq!(
        s.record_hits(&mut idx, &keys, &placement, &loads, 0.0),
        None
    );
    // Second hit on blocks 1 and 2: block 2 (index 1) is the deepest hot block. Candidates
    // lacking block 2: 1, 2, 3 (0 is the chosen instance); least loaded first: 3, 2.
    assert_eq!(
        s.record_hits(&mut idx, &keys, &placement, &loads, 0.0),
        Some(Replication {
            blocks: 2,
            targets: vec![3, 2]
        })
    );
    assert_eq!(idx.hits(1), 2);
    assert_eq!(idx.hits(9), 0);
}

#[test]
fn bad_config_is_named() {
    let mut c = config(Policy::Conductor, Rejection::None, 1);
    c.pool_bandwidth_bps = 0.0;
    let err = Scheduler::new(c, 1).unwrap_err();
    assert!(err.to_string().contains("pool bandwidth"), "{err}");
    assert_eq!(err.category(), "not_positive");
    assert_eq!(
        Scheduler::new(config(Policy::Conductor, Rejection::None, 0), 1).unwrap_err(),
        ConfigError::PrefillInstances { got: 0 }
    );
    assert_eq!(
        Scheduler::new(config(Policy::Conductor, Rejection::None, 1), 0).unwrap_err(),
        ConfigError::NoDecodeInstances
    );
}

#[test]
fn every_policy_keeps_to_the_eligible_instances() {
    // Instance 0 holds the prefix and is idle, so unrestricted choices would take it; only
    // prefill 2 and decode 1 are eligible (they serve the request's model).
    let idx = index();
    let r = four_block_request();
    let eligible = Eligible {
        prefill: Some(vec![false, false, true]),
        decode: Some(vec![false, true]),
    };
    let decode = [DecodeLoad::default(), DecodeLoad::default()];
    for policy in [
        Policy::Conductor,
        Policy::LocalOnly,
        Policy::CacheAware,
        Policy::LeastLoad,
        Policy::RoundRobin,
        Policy::Random,
    ] {
        let mut s = Scheduler::new(config(policy, Rejection::None, 3), 2).unwrap();
        s.set_eligible(eligible.clone());
        for _ in 0..4 {
            let p = accept(s.decide(0.0, &r, &idx, &free_at(&[0.0, 0.0, 0.0]), &decode));
            assert_eq!((p.prefill, p.decode), (2, 1), "{policy:?}");
        }
        // No eligible instance of a role: nothing can serve the request.
        s.set_eligible(Eligible {
            prefill: Some(vec![false; 3]),
            ..eligible.clone()
        });
        let d = s.decide(0.0, &r, &idx, &free_at(&[0.0, 0.0, 0.0]), &decode);
        assert!(
            matches!(d, Decision::Reject(RejectReason::NoInstance)),
            "{policy:?}: {d:?}"
        );
        // Lifted: instance 0 (the prefix holder) again for the conductor policy.
        s.set_eligible(Eligible::default());
        let p = accept(s.decide(0.0, &r, &idx, &free_at(&[0.0, 0.0, 0.0]), &decode));
        if policy == Policy::Conductor {
            assert_eq!(p.prefill, 0);
        }
    }
}
