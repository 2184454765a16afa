//! `kvpool simulate-cache`: replays a Mooncake request trace against one global block cache
//! run by an eviction policy of [`super::policy`], and reports the prefix hit ratio.
//! I/O boundary: reading the trace file; the replay itself is pure.
//!
//! Model: every request looks up its block chain (`hash_ids`) in order; a block counts as a hit
//! only while every block before it in the request hit too (prefix caching: a block after a
//! miss has to be recomputed). Hit blocks are accessed; missing blocks are inserted, evicting
//! the policy's victim while the cache is full. Hit ratio = hit blocks / looked-up blocks.

use std::collections::HashMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::policy::PolicyKind;

/// Errors of the trace simulator.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum SimulateError {
    #[error("cannot read trace {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("trace {path} line {line}: not a trace record")]
    Parse {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("capacity must be at least 1 block")]
    Capacity,
}

impl SimulateError {
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// The fields of a trace record the simulator needs.
#[derive(Debug, Clone, Deserialize)]
pub struct TraceRecord {
    pub hash_ids: Vec<u64>,
}

/// Read a JSONL trace.
pub fn read_trace(path: &Path) -> Result<Vec<TraceRecord>, SimulateError> {
    let file = std::fs::File::open(path).map_err(|source| SimulateError::Read {
        path: path.to_owned(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|source| SimulateError::Read {
            path: path.to_owned(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let rec = serde_json::from_str(&line).map_err(|source| SimulateError::Parse {
            path: path.to_owned(),
            line: i + 1,
            source,
        })?;
        out.push(rec);
    }
    Ok(out)
}

/// Outcome of one replay.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimResult {
    pub policy: PolicyKind,
    /// `None`: unlimited.
    pub capacity_blocks: Option<u64>,
    pub requests: u64,
    pub blocks: u64,
    pub hit_blocks: u64,
    pub hit_ratio: f64,
    pub evictions: u64,
}

/// Distinct blocks the trace references: the capacity at which nothing is ever evicted.
pub fn working_set_blocks(trace: &[TraceRecord]) -> u64 {
    let mut seen = std::collections::HashSet::new();
    for rec in trace {
        seen.extend(rec.hash_ids.iter().copied());
    }
    seen.len() as u64
}

/// `percent` of `working_set` blocks, rounded up (at least one block).
pub fn blocks_for_percent(working_set: u64, percent: f64) -> u64 {
    ((working_set as f64 * percent / 100.0).ceil() as u64).max(1)
}

/// Replay `trace` against a cache of `capacity` blocks (`None` = unlimited).
pub fn simulate(
    trace: &[TraceRecord],
    policy: PolicyKind,
    capacity: Option<u64>,
) -> Result<SimResult, SimulateError> {
    if capacity == Some(0) {
        return Err(SimulateError::Capacity);
    }
    let mut p = policy.build();
    let mut slot_of: HashMap<u64, u32> = HashMap::new();
    let mut key_of: Vec<u64> = Vec::new();
    let mut free: Vec<u32> = Vec::new();
    let (mut blocks, mut hits, mut evictions) = (0u64, 0u64, 0u64);
    for rec in trace {
        let mut prefix = true;
        for &id in &rec.hash_ids {
            blocks += 1;
            if let Some(&slot) = slot_of.get(&id) {
                p.touch(slot);
                if prefix {
                    hits += 1;
                }
                continue;
            }
            prefix = false;
            if let Some(cap) = capacity
                && slot_of.len() as u64 >= cap
                && let Some(victim) = p.evict(&mut |_| true)
            {
                slot_of.remove(&key_of[victim as usize]);
                free.push(victim);
                evictions += 1;
            }
            let slot = match free.pop() {
                Some(s) => {
                    key_of[s as usize] = id;
                    s
                }
                None => {
                    key_of.push(id);
                    (key_of.len() - 1) as u32
                }
            };
            slot_of.insert(id, slot);
            p.insert(slot, id);
        }
    }
    Ok(SimResult {
        policy,
        capacity_blocks: capacity,
        requests: trace.len() as u64,
        blocks,
        hit_blocks: hits,
        hit_ratio: if blocks == 0 {
            0.0
        } else {
            hits as f64 / blocks as f64
        },
        evictions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ids: &[u64]) -> TraceRecord {
        TraceRecord {
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn counts_only_prefix_hits() {
        let trace = vec![rec(&[1, 2, 3]), rec(&[1, 9, 3]), rec(&[1, 2, 3])];
        let r = simulate(&trace, PolicyKind::Lru, None).expect("sim");
        // Second request: 1 hits, 9 misses, so 3 no longer counts. Third: all three hit.
        assert_eq!((r.blocks, r.hit_blocks, r.evictions), (9, 4, 0));
    }

    #[test]
    fn capacity_bounds_the_cache_and_policies_differ_on_scans() {
        // A hot 2-block chain, then scans of single-use blocks between its reuses.
        let mut trace = Vec::new();
        let mut next = 100;
        for _ in 0..50 {
            trace.push(rec(&[1, 2]));
            trace.push(rec(&[1, 2]));
            let scan: Vec<u64> = (next..next + 6).collect();
            next += 6;
            trace.push(rec(&scan));
        }
        let lru = simulate(&trace, PolicyKind::Lru, Some(6)).expect("lru");
        let s3 = simulate(&trace, PolicyKind::S3fifo, Some(6)).expect("s3");
        assert!(lru.evictions > 0);
        assert!(
            s3.hit_blocks > lru.hit_blocks,
            "s3fifo {s3:?} should beat lru {lru:?} on a scan"
        );
        assert!(matches!(
            simulate(&trace, PolicyKind::Lru, Some(0)),
            Err(SimulateError::Capacity)
        ));
    }

    #[test]
    fn working_set_counts_distinct_blocks_and_percentages_round_up() {
        let trace = vec![rec(&[1, 2, 3]), rec(&[1, 9, 3]), rec(&[])];
        assert_eq!(working_set_blocks(&trace), 4);
        assert_eq!(blocks_for_percent(4, 50.0), 2);
        assert_eq!(blocks_for_percent(4, 10.0), 1);
        assert_eq!(blocks_for_percent(1000, 0.01), 1);
        // At 100% of the working set nothing is evicted, whatever the policy.
        for policy in PolicyKind::ALL {
            let r = simulate(&trace, policy, Some(4)).expect("sim");
            assert_eq!(r.evictions, 0, "{policy:?}");
            assert_eq!(
                r.hit_blocks,
                simulate(&trace, policy, None).expect("inf").hit_blocks
            );
        }
    }

    #[test]
    fn lfu_keeps_a_hot_chain_through_repeated_scans() {
        // The shape of the scan test above, with the hot chain reused three times between
        // scans: its counters outgrow the scans' (which are referenced once).
        let mut trace = Vec::new();
        let mut next = 100;
        for _ in 0..50 {
            for _ in 0..3 {
                trace.push(rec(&[1, 2]));
            }
            trace.push(rec(&(next..next + 6).collect::<Vec<_>>()));
            next += 6;
        }
        let lru = simulate(&trace, PolicyKind::Lru, Some(6)).expect("lru");
        let lfu = simulate(&trace, PolicyKind::Lfu, Some(6)).expect("lfu");
        assert!(
            lfu.hit_blocks > lru.hit_blocks,
            "lfu {lfu:?} vs lru {lru:?}"
        );
        // After the first pass, every reuse of the chain hits under LFU.
        assert_eq!(lfu.hit_blocks, 50 * 3 * 2 - 2);
    }

    #[test]
    fn bad_trace_lines_are_reported_with_their_number() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("t.jsonl");
        std::fs::write(&path, "{\"hash_ids\": [1]}\n\nnot json\n").expect("write");
        let err = read_trace(&path).expect_err("bad line");
        assert!(matches!(err, SimulateError::Parse { line: 3, .. }), "{err}");
        assert!(matches!(
            read_trace(&dir.path().join("missing")),
            Err(SimulateError::Read { .. })
        ));
    }
}
