//! Decision-latency benchmark: times `Scheduler::decide` against a prefix index of many blocks
//! with many prefill and decode instances, and measures the index's memory per block.
//! I/O boundary: reads the monotonic clock and /proc/self/statm (resident memory); the rest is
//! the pure policy core.

use std::num::NonZeroU32;
use std::time::Instant;

use hdrhistogram::Histogram;

use crate::sched::rng::SplitMix64;
use crate::sched::{
    DecodeCost, DecodeLoad, DecodeMember, HotConfig, Policy, PrefillCost, PrefillLoad, PrefixIndex,
    Rejection, Request, Scheduler, SchedulerConfig, Slo,
};

/// Shape of the benchmark.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct BenchConfig {
    pub prefill_instances: usize,
    pub decode_instances: usize,
    /// Blocks in the index.
    pub blocks: usize,
    /// Blocks per prefix chain (the longest request prefix).
    pub chain_blocks: usize,
    /// Prefill instances that hold each chain's leading blocks locally.
    pub holders_per_chain: usize,
    /// Running requests per decode instance.
    pub running_per_decode: usize,
    pub decisions: usize,
    pub seed: u64,
}

impl Default for BenchConfig {
    fn default() -> Self {
        Self {
            prefill_instances: 64,
            decode_instances: 64,
            blocks: 1_000_000,
            chain_blocks: 250,
            holders_per_chain: 4,
            running_per_decode: 32,
            decisions: 100_000,
            seed: 1,
        }
    }
}

/// Results of the benchmark.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchReport {
    pub config: BenchConfig,
    pub indexed_blocks: usize,
    pub mean_request_blocks: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    pub mean_us: f64,
    /// Bytes of the index's table (every bucket) per indexed block.
    pub index_bytes_per_block: f64,
    /// Growth of resident memory while building the index, per block (Linux only).
    pub rss_bytes_per_block: Option<f64>,
}

/// Errors of the benchmark.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum BenchError {
    #[error("invalid benchmark shape: {0}")]
    Shape(&'static str),
    #[error("invalid scheduler configuration")]
    Config(#[source] crate::sched::ConfigError),
    #[error("invalid prefix index configuration")]
    Index(#[source] crate::sched::IndexError),
    #[error("cannot create the latency histogram")]
    Histogram(#[source] hdrhistogram::CreationError),
}

impl BenchError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// Runs the benchmark.
pub fn run(cfg: BenchConfig) -> Result<BenchReport, BenchError> {
    run_with(cfg, &mut |_, _| {})
}

/// [`run`], calling `between(index, keys)` before every decision (untimed): what streams into
/// the index between decisions (the conductor applies engines' KV events there). `keys` are
/// the indexed chains' keys, chain after chain of `chain_blocks`.
pub fn run_with(
    cfg: BenchConfig,
    between: &mut dyn FnMut(&mut PrefixIndex, &[u64]),
) -> Result<BenchReport, BenchError> {
    if cfg.chain_blocks == 0 || cfg.blocks < cfg.chain_blocks || cfg.decisions == 0 {
        return Err(BenchError::Shape(
            "need chain_blocks >= 1, blocks >= chain_blocks and decisions >= 1",
        ));
    }
    let mut rng = SplitMix64(cfg.seed);
    let chains = cfg.blocks / cfg.chain_blocks;
    let keys: Vec<u64> = (0..chains * cfg.chain_blocks).map(|_| rng.next()).collect();

    let rss_before = resident_bytes();
    let mut index = PrefixIndex::new(cfg.prefill_instances).map_err(BenchError::Index)?;
    for (c, chain) in keys.chunks(cfg.chain_blocks).enumerate() {
        for &k in chain {
            index.add_pool_replica(k);
        }
        for h in 0..cfg.holders_per_chain {
            let inst = (c * 7 + h * 13) % cfg.prefill_instances.max(1);
            let len = 1 + rng.below(cfg.chain_blocks);
            for &k in &chain[..len] {
                index.add_local(k, inst);
            }
        }
    }
    let rss_after = resident_bytes();
    let indexed_blocks = index.len();

    let config = SchedulerConfig {
        policy: Policy::Conductor,
        rejection: Rejection::Predicted,
        slo: Slo {
            ttft_s: 30.0,
            tpot_s: 0.1,
        },
        block_size: NonZeroU32::new(512).unwrap_or(NonZeroU32::MIN),
        bytes_per_token: 327_680,
        pool_bandwidth_bps: 25e9,
        kv_bandwidth_bps: 25e9,
        prefill_costs: vec![PrefillCost::default(); cfg.prefill_instances],
        decode_cost: DecodeCost::default(),
        handoff: Default::default(),
        decode_kv_capacity_tokens: 1_500_000,
        hot: HotConfig {
            threshold: 0,
            fanout: 0,
        },
        seed: cfg.seed,
    };
    let mut sched = Scheduler::new(config, cfg.decode_instances).map_err(BenchError::Config)?;
    let prefill: Vec<PrefillLoad> = (0..cfg.prefill_instances)
        .map(|_| PrefillLoad {
            free_at_s: rng.below(10_000) as f64 / 1000.0,
        })
        .collect();
    let member = |rng: &mut SplitMix64, id: usize, joins: f64| DecodeMember {
        request: id as u64,
        context_tokens: 1000 + rng.below(30_000) as u64,
        remaining_tokens: 1 + rng.below(500) as u32,
        joins_at_s: joins,
    };
    let decode: Vec<DecodeLoad> = (0..cfg.decode_instances)
        .map(|_| DecodeLoad {
            running: (0..cfg.running_per_decode)
                .map(|i| member(&mut rng, i, 0.0))
                .collect(),
            pending: (0..4)
                .map(|i| {
                    let joins = rng.below(5000) as f64 / 1000.0;
                    member(&mut rng, i, joins)
                })
                .collect(),
        })
        .collect();

    let mut hist =
        Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).map_err(BenchError::Histogram)?;
    let mut req_keys: Vec<u64> = Vec::with_capacity(cfg.chain_blocks + 8);
    let mut total_blocks = 0u64;
    let mut sink = 0usize;
    for _ in 0..cfg.decisions {
        between(&mut index, &keys);
        let c = rng.below(chains);
        let prefix = 1 + rng.below(cfg.chain_blocks);
        req_keys.clear();
        req_keys.extend_from_slice(&keys[c * cfg.chain_blocks..c * cfg.chain_blocks + prefix]);
        for _ in 0..rng.below(8) {
            req_keys.push(rng.next());
        }
        total_blocks += req_keys.len() as u64;
        let req = Request {
            keys: &req_keys,
            input_tokens: req_keys.len() as u64 * 512,
            output_tokens: 300,
        };
        let start = Instant::now();
        let d = sched.decide(0.0, &req, &index, &prefill, &decode);
        let ns = start.elapsed().as_nanos() as u64;
        hist.saturating_record(ns.max(1));
        sink ^= matches!(d, crate::sched::Decision::Accept(_)) as usize;
    }
    std::hint::black_box(sink);
    let us = |ns: u64| ns as f64 / 1000.0;
    Ok(BenchReport {
        config: cfg,
        indexed_blocks,
        mean_request_blocks: total_blocks as f64 / cfg.decisions as f64,
        p50_us: us(hist.value_at_quantile(0.5)),
        p99_us: us(hist.value_at_quantile(0.99)),
        max_us: us(hist.max()),
        mean_us: hist.mean() / 1000.0,
        index_bytes_per_block: index.memory_bytes() as f64 / indexed_blocks.max(1) as f64,
        rss_bytes_per_block: match (rss_before, rss_after) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / indexed_blocks.max(1) as f64),
            _ => None,
        },
    })
}

impl BenchReport {
    pub fn to_text(&self) -> String {
        format!(
            "decision latency over {} decisions ({} prefill, {} decode instances, {} indexed blocks, {:.1} blocks per request)\n\
             p50 {:.1} us  p99 {:.1} us  max {:.1} us  mean {:.1} us\n\
             index memory {:.1} B/block (table){}\n",
            self.config.decisions,
            self.config.prefill_instances,
            self.config.decode_instances,
            self.indexed_blocks,
            self.mean_request_blocks,
            self.p50_us,
            self.p99_us,
            self.max_us,
            self.mean_us,
            self.index_bytes_per_block,
            self.rss_bytes_per_block
                .map(|b| format!(", {b:.1} B/block (resident memory growth)"))
                .unwrap_or_default()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_bench_runs_and_counts_blocks() {
        let r = run(BenchConfig {
            prefill_instances: 8,
            decode_instances: 4,
            blocks: 2_000,
            chain_blocks: 100,
            holders_per_chain: 2,
            running_per_decode: 4,
            decisions: 200,
            seed: 3,
        })
        .unwrap();
        assert_eq!(r.indexed_blocks, 2_000);
        assert!(r.p50_us > 0.0 && r.p99_us >= r.p50_us);
        // 32-byte slots, between 3/8 and 3/4 of them used: 4/3 to 8/3 slots per entry.
        assert!(
            r.index_bytes_per_block >= 32.0 * 4.0 / 3.0,
            "{}",
            r.index_bytes_per_block
        );
        assert!(r.index_bytes_per_block <= 32.0 * 8.0 / 3.0 + 1.0);
        assert!(matches!(
            run(BenchConfig {
                chain_blocks: 0,
                ..BenchConfig::default()
            }),
            Err(BenchError::Shape(_))
        ));
    }
}
