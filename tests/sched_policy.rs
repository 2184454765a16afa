//! Policy core end to end through the public API: token ids -> chained block keys -> global
//! prefix index -> a scheduling decision with a cost model fitted from a profile.

use std::num::NonZeroU32;

use kvpool_core::sched::{
    Decision, DecodeCost, DecodeLoad, HotConfig, Policy, PrefillCost, PrefillLoad, PrefixIndex,
    Rejection, Request, Scheduler, SchedulerConfig, Slo, block_keys,
};

fn config(policy: Policy, costs: Vec<PrefillCost>) -> SchedulerConfig {
    SchedulerConfig {
        policy,
        rejection: Rejection::Early,
        slo: Slo {
            ttft_s: 5.0,
            tpot_s: 0.1,
        },
        block_size: NonZeroU32::new(16).expect("16 is not zero"),
        bytes_per_token: 1_000,
        pool_bandwidth_bps: 1e6,
        kv_bandwidth_bps: 1e9,
        prefill_costs: costs,
        decode_cost: DecodeCost::default(),
        handoff: Default::default(),
        decode_kv_capacity_tokens: 1_000_000,
        hot: HotConfig {
            threshold: 0,
            fanout: 0,
        },
        seed: 1,
    }
}

#[test]
fn shared_prefix_steers_the_request_to_the_instance_that_holds_it() {
    let bs = NonZeroU32::new(16).unwrap();
    // A 64-token system prompt followed by two different user turns.
    let system: Vec<u32> = (1000..1064).collect();
    let mut first = system.clone();
    first.extend(0..40);
    let mut second = system.clone();
    second.extend(500..540);
    let k1 = block_keys(&first, bs);
    let k2 = block_keys(&second, bs);
    assert_eq!(k1.len(), 7);
    assert_eq!(k1[..4], k2[..4], "the system prompt's 4 blocks are shared");
    assert_ne!(k1[4], k2[4]);

    // The first request ran on instance 2: its blocks are there (not in the pool).
    let mut index = PrefixIndex::new(3).unwrap();
    for &k in &k1 {
        index.add_local(k, 2);
    }
    // Instances fitted from a profile of 1 ms per token: 16, 32 and 64 tokens.
    let profile = [(16, 0.016), (32, 0.032), (64, 0.064), (128, 0.128)];
    let cost = PrefillCost::fit(&profile).unwrap();
    assert!((cost.linear_s - 0.001).abs() < 1e-9 && cost.quadratic_s.abs() < 1e-12);
    let mut s = Scheduler::new(config(Policy::Conductor, vec![cost; 3]), 1).unwrap();
    let req = Request {
        keys: &k2,
        input_tokens: second.len() as u64,
        output_tokens: 8,
    };
    // Instance 2 has a 10 ms queue; the others are idle. Its cached 64 tokens save 64 ms.
    let loads = [
        PrefillLoad { free_at_s: 0.0 },
        PrefillLoad { free_at_s: 0.0 },
        PrefillLoad { free_at_s: 0.010 },
    ];
    let Decision::Accept(p) = s.decide(0.0, &req, &index, &loads, &[DecodeLoad::default()]) else {
        panic!("rejected")
    };
    assert_eq!(p.prefill, 2);
    assert_eq!(p.cached_tokens, 64);
    // 10 ms queue + 40 uncached tokens at 1 ms.
    assert!((p.ttft.total_s() - 0.050).abs() < 1e-6, "{:?}", p.ttft);

    // Least-load ignores the cache and pays the whole 104 tokens on instance 0.
    let mut ll = Scheduler::new(config(Policy::LeastLoad, vec![cost; 3]), 1).unwrap();
    let Decision::Accept(p) = ll.decide(0.0, &req, &index, &loads, &[DecodeLoad::default()]) else {
        panic!("rejected")
    };
    assert_eq!(p.prefill, 0);
    assert!((p.ttft.total_s() - 0.104).abs() < 1e-6, "{:?}", p.ttft);
}

#[test]
fn queue_outweighs_cache_when_the_holder_is_busy() {
    let bs = NonZeroU32::new(16).unwrap();
    let tokens: Vec<u32> = (0..160).collect();
    let keys = block_keys(&tokens, bs);
    let mut index = PrefixIndex::new(2).unwrap();
    for &k in &keys[..9] {
        index.add_local(k, 0);
    }
    let cost = PrefillCost {
        fixed_s: 0.0,
        linear_s: 0.001,
        quadratic_s: 0.0,
    };
    let mut s = Scheduler::new(config(Policy::Conductor, vec![cost; 2]), 1).unwrap();
    let req = Request {
        keys: &keys,
        input_tokens: 160,
        output_tokens: 8,
    };
    // Instance 0: 1 s queue + 16 tokens = 1.016 s; instance 1: 160 tokens = 0.16 s.
    let loads = [
        PrefillLoad { free_at_s: 1.0 },
        PrefillLoad { free_at_s: 0.0 },
    ];
    let Decision::Accept(p) = s.decide(0.0, &req, &index, &loads, &[DecodeLoad::default()]) else {
        panic!("rejected")
    };
    assert_eq!(p.prefill, 1);
    // Once the pool holds the prefix, instance 1 fetches its 9 blocks (144 KB) at 2 MB/s in
    // 0.072 s instead of computing 144 tokens in 0.144 s.
    for &k in &keys[..9] {
        index.add_pool_replica(k);
    }
    let mut cfg = config(Policy::Conductor, vec![cost; 2]);
    cfg.pool_bandwidth_bps = 2e6;
    let mut s = Scheduler::new(cfg, 1).unwrap();
    let Decision::Accept(p) = s.decide(0.0, &req, &index, &loads, &[DecodeLoad::default()]) else {
        panic!("rejected")
    };
    assert_eq!(p.prefill, 1);
    assert_eq!(p.prefix.pool_blocks(), 9);
    assert!(
        (p.ttft.total_s() - (0.072 + 0.016)).abs() < 1e-9,
        "{:?}",
        p.ttft
    );
}
