//! Hot prefixes copied in the pool: when the policy plans a hot-prefix replication, the master
//! is asked to keep more copies of the prefix's blocks for a while (`ReplicateHot`), which it
//! makes on other agents; engines that load the prefix then read a nearby copy, whatever
//! engine they are (docs/scheduling.md "Hot blocks"). I/O boundary: the master call (spawned,
//! fire and forget, within the bound on background calls in flight).

use std::sync::Arc;
use std::time::Duration;

use kvpool_runtime::telemetry::chain;

use super::shared::Shared;

/// Longest wait for the master's answer.
const REPLICATE_TIMEOUT: Duration = Duration::from_secs(5);

/// Asks the master for more copies of the blocks named `names` (a hot prefix, first block
/// first), when the conductor has a master and hot copies are on; `None` names (the pool key
/// contract names blocks by engine hashes this conductor did not compute) are counted.
pub(super) fn replicate_in_pool(shared: &Arc<Shared>, names: Option<Vec<Vec<u8>>>) {
    let Some(pool) = shared.config.pool.clone() else {
        return;
    };
    let Some(hot) = pool.hot else {
        return;
    };
    let Some(names) = names.filter(|n| !n.is_empty()) else {
        shared
            .metrics
            .hot_pool
            .with_label_values(&["unnamed"])
            .inc();
        return;
    };
    let Some(permit) = shared.background_slot(&shared.metrics.hot_pool) else {
        return;
    };
    let shared = shared.clone();
    tokio::spawn(async move {
        let _permit = permit;
        let refs: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
        let call = pool.client.replicate_hot(&refs, hot.replicas, hot.ttl);
        let outcome = match tokio::time::timeout(REPLICATE_TIMEOUT, call).await {
            Err(_) => "timeout",
            Ok(Err(e)) => {
                tracing::warn!(error = %chain(&e), "hot prefix: the master refused more copies");
                "error"
            }
            Ok(Ok(results)) => {
                let missing = results.iter().filter(|r| r.is_err()).count();
                tracing::info!(blocks = names.len(), missing, replicas = hot.replicas,
                    ttl = ?hot.ttl, "hot prefix: more copies asked of the pool");
                // Blocks not (or no longer) in the pool cannot be copied.
                if missing == 0 { "ok" } else { "partial" }
            }
        };
        shared.metrics.hot_pool.with_label_values(&[outcome]).inc();
    });
}
