//! The per-request question to the pool's master: how many of the prompt's leading blocks the
//! pool holds, under a timeout, with a back-off after a failure so that a master that is down
//! costs one timeout per interval rather than one per request. I/O boundary: the master's gRPC
//! client (`longest_prefix`) and the monotonic clock.

use kvpool_runtime::telemetry::chain;
use std::time::{Duration, Instant};

use super::shared::Shared;
use crate::config::PoolLookup;
use kvpool_core::sched::{BlockKey, EngineHash};

/// After a pool lookup fails or times out, requests skip the lookup this long, so a master that
/// is down or hanging costs at most one timeout per interval rather than one per request.
pub const POOL_LOOKUP_BACKOFF: Duration = Duration::from_secs(2);

/// How many leading blocks of `keys` (with their engine hashes `hashes`, where the hashing
/// computes them) the pool holds, asked under the names of `pool.keys`, by one
/// `longest_prefix` call to the master under `pool.timeout`. A failed or slow call is counted and answers 0: the request is
/// then placed on the engines' local caches alone, and so are those of the next
/// [`POOL_LOOKUP_BACKOFF`] (counted as `backoff`).
pub(super) async fn pool_prefix(
    shared: &Shared,
    pool: &PoolLookup,
    model: &str,
    keys: &[BlockKey],
    hashes: Option<&[EngineHash]>,
) -> usize {
    let lookups = &shared.metrics.pool_lookups;
    if keys.is_empty() {
        return 0;
    }
    if shared
        .pool_backoff_until
        .lock()
        .is_some_and(|until| Instant::now() < until)
    {
        lookups.with_label_values(&["backoff"]).inc();
        return 0;
    }
    let Some(names) = pool.keys.names(model, keys, hashes) else {
        // The contract names blocks by engine hashes this conductor does not compute.
        lookups.with_label_values(&["unnamed"]).inc();
        return 0;
    };
    let refs: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
    let timer = shared.metrics.pool_lookup_seconds.start_timer();
    let answer = tokio::time::timeout(pool.timeout, pool.client.longest_prefix(&refs)).await;
    timer.observe_duration();
    let (outcome, blocks) = match answer {
        Ok(Ok(0)) => ("miss", 0),
        Ok(Ok(n)) => ("hit", n.min(keys.len())),
        Ok(Err(e)) => {
            tracing::warn!(error = %chain(&e),
                    "pool lookup failed; placing on local caches only");
            ("error", 0)
        }
        Err(_) => {
            tracing::warn!(timeout = ?pool.timeout,
                    "pool lookup timed out; placing on local caches only");
            ("timeout", 0)
        }
    };
    if matches!(outcome, "error" | "timeout") {
        *shared.pool_backoff_until.lock() = Some(Instant::now() + POOL_LOOKUP_BACKOFF);
    }
    lookups.with_label_values(&[outcome]).inc();
    blocks
}
