//! Property tests of the trace simulator: hit ratios against an independent count of "blocks
//! seen before", LRU monotonicity, and conservation of requests.

use std::collections::HashSet;
use std::num::NonZeroU32;

use kvpool_core::sched::{
    DecodeCost, HotConfig, Policy, PrefillCost, Rejection, SchedulerConfig, Slo,
};
use kvpool_core::sim::{SimConfig, TraceRecord, UNLIMITED, run};
use proptest::prelude::*;

const BLOCK: u64 = 512;

fn config(
    policy: Policy,
    rejection: Rejection,
    prefill: usize,
    local: usize,
    pool: usize,
) -> SimConfig {
    SimConfig {
        scheduler: SchedulerConfig {
            policy,
            rejection,
            slo: Slo {
                ttft_s: 30.0,
                tpot_s: 0.1,
            },
            block_size: NonZeroU32::new(BLOCK as u32).expect("512 is not zero"),
            bytes_per_token: 327_680,
            pool_bandwidth_bps: 25e9,
            kv_bandwidth_bps: 25e9,
            prefill_costs: vec![PrefillCost::default(); prefill],
            decode_cost: DecodeCost::default(),
            handoff: Default::default(),
            decode_kv_capacity_tokens: 1_500_000,
            hot: HotConfig {
                threshold: 3,
                fanout: 2,
            },
            seed: 9,
        },
        decode_instances: 3,
        local_cache_blocks: local,
        pool_blocks: pool,
        autoscale: None,
        autoscale_decode: None,
        time_scale: 1.0,
    }
}

/// A trace whose requests extend a prefix of an earlier request (or start fresh) with new
/// blocks, as conversations do. Ids are prefix hashes: equal id at position i means an equal
/// prefix up to block i.
fn trace_strategy() -> impl Strategy<Value = Vec<TraceRecord>> {
    // (parent choice, prefix fraction, new blocks, gap ms, output tokens)
    prop::collection::vec(
        (
            any::<prop::sample::Index>(),
            0.0f64..=1.0,
            0usize..6,
            0u64..3000,
            1u32..200,
        ),
        1..60,
    )
    .prop_map(|specs| {
        let mut next_id = 0u64;
        let mut t = 0u64;
        let mut out: Vec<TraceRecord> = Vec::new();
        for (parent, frac, fresh, gap, output) in specs {
            let mut ids: Vec<u64> = if out.is_empty() {
                Vec::new()
            } else {
                let p = &out[parent.index(out.len())].hash_ids;
                let keep = (p.len() as f64 * frac) as usize;
                p[..keep].to_vec()
            };
            for _ in 0..fresh.max(usize::from(ids.is_empty())) {
                ids.push(next_id);
                next_id += 1;
            }
            t += gap;
            out.push(TraceRecord {
                timestamp_ms: t,
                input_length: ids.len() as u64 * BLOCK - 100,
                output_length: output,
                hash_ids: ids,
            });
        }
        out
    })
}

/// Blocks whose id appeared in an earlier request (computed without the simulator).
fn seen_before(trace: &[TraceRecord]) -> (u64, u64) {
    let mut seen = HashSet::new();
    let (mut hits, mut total) = (0, 0);
    for r in trace {
        for id in &r.hash_ids {
            total += 1;
            if seen.contains(id) {
                hits += 1;
            }
        }
        seen.extend(r.hash_ids.iter().copied());
    }
    (hits, total)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// With an unlimited pool, whatever instance a policy picks, every block seen before is a
    /// hit and nothing else is.
    #[test]
    fn unlimited_pool_hits_exactly_the_blocks_seen_before(
        trace in trace_strategy(),
        policy in prop::sample::select(vec![
            Policy::Conductor, Policy::CacheAware, Policy::LeastLoad, Policy::RoundRobin,
            Policy::Random,
        ]),
        prefill in 1usize..5,
        local in prop::sample::select(vec![0usize, 3, UNLIMITED]),
    ) {
        let (outcomes, _) = run(&trace, &config(policy, Rejection::None, prefill, local, UNLIMITED)).unwrap();
        let matched: u64 = outcomes.iter().map(|o| u64::from(o.matched_blocks)).sum();
        let total: u64 = outcomes.iter().map(|o| u64::from(o.blocks)).sum();
        prop_assert_eq!((matched, total), seen_before(&trace));
        prop_assert!(outcomes.iter().all(|o| o.rejected.is_none()));
    }

    /// Local caches only, one instance, unlimited: the local cache is the global one.
    #[test]
    fn one_unlimited_local_cache_hits_the_blocks_seen_before(trace in trace_strategy()) {
        let (outcomes, _) = run(&trace, &config(Policy::LocalOnly, Rejection::None, 1, UNLIMITED, 0)).unwrap();
        let matched: u64 = outcomes.iter().map(|o| u64::from(o.matched_blocks)).sum();
        let local: u64 = outcomes.iter().map(|o| u64::from(o.local_blocks)).sum();
        let (seen, _) = seen_before(&trace);
        prop_assert_eq!(matched, seen);
        prop_assert_eq!(local, seen);
    }

    /// LRU is a stack algorithm: a bigger cache holds a superset, so it never hits less.
    #[test]
    fn bigger_lru_never_hits_less(trace in trace_strategy(), small in 0usize..20, extra in 1usize..20) {
        let hits = |cap| {
            let (o, _) = run(&trace, &config(Policy::LocalOnly, Rejection::None, 1, cap, 0)).unwrap();
            o.iter().map(|o| u64::from(o.matched_blocks)).sum::<u64>()
        };
        prop_assert!(hits(small) <= hits(small + extra));
    }

    /// Every request is either served or rejected; served ones finish after they arrive and
    /// their TTFT is at least the prefill time of their uncached tokens.
    #[test]
    fn requests_are_conserved_and_causal(
        trace in trace_strategy(),
        rejection in prop::sample::select(vec![Rejection::None, Rejection::Early, Rejection::Predicted, Rejection::AtDecode]),
        scale in prop::sample::select(vec![1.0f64, 50.0]),
    ) {
        let mut cfg = config(Policy::Conductor, rejection, 2, 8, 50);
        cfg.time_scale = scale;
        let (outcomes, _) = run(&trace, &cfg).unwrap();
        prop_assert_eq!(outcomes.len(), trace.len());
        let cost = PrefillCost::default();
        for (o, r) in outcomes.iter().zip(&trace) {
            if o.rejected.is_some() {
                prop_assert_ne!(rejection, Rejection::None);
                continue;
            }
            prop_assert!(o.ttft_s >= cost.seconds(o.cached_tokens, r.input_length) - 1e-9);
            prop_assert!(o.decode_arrival_s >= o.arrival_s + o.ttft_s - 1e-9);
            prop_assert!(o.finish_s > o.decode_arrival_s);
            prop_assert!(o.local_blocks <= o.matched_blocks && o.matched_blocks <= o.blocks);
        }
    }
}
