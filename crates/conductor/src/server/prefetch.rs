//! Hot-prefix replication: a replication task the policy planned is counted, logged and carried
//! out by asking each target prefill engine to prefetch the blocks from the pool
//! (`POST /kvpool/v1/prefetch`), within a bound on prefetches in flight; the cache mirror adopts
//! what an engine reports loaded. I/O boundary: the prefetch calls to the engines (spawned, fire
//! and forget).

use kvpool_runtime::telemetry::chain;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use serde_json::Value;

use super::members::Members;
use super::shared::Shared;
use super::upstream::{UpstreamError, engine_url, read_body};
use crate::state::ReplicationTask;
use kvpool_core::sched::BlockKey;
use kvpool_proto::prefetch::{PREFETCH_PATH, prefetch_body};

/// Prefetch requests (hot-prefix copies) in flight at most; more tasks are dropped and counted.
pub const MAX_PREFETCHES_IN_FLIGHT: usize = 8;
/// Longest wait for an engine to finish one prefetch.
const PREFETCH_TIMEOUT: Duration = Duration::from_secs(60);

/// Counts, logs and executes a replication task: each target engine is asked to prefetch the
/// blocks from the pool ([`prefetch`]). `prefill` is the engine set the task's target indices
/// refer to.
pub(super) fn replicate(shared: &Arc<Shared>, task: &ReplicationTask, prefill: &[String]) {
    shared.metrics.replication_tasks.inc();
    let targets: Vec<&String> = task
        .targets
        .iter()
        .filter_map(|&t| prefill.get(t))
        .collect();
    for url in &targets {
        shared
            .metrics
            .replication_blocks
            .with_label_values(&[url.as_str()])
            .inc_by(task.keys.len() as u64);
    }
    tracing::info!(
        blocks = task.keys.len(),
        first_key = task.keys.first().copied().unwrap_or(0),
        last_key = task.keys.last().copied().unwrap_or(0),
        ?targets,
        "hot prefix: asking engines to prefetch it from the pool"
    );
    for url in targets {
        prefetch(shared, url.clone(), task.keys.clone());
    }
}

/// Fire and forget: asks prefill engine `url` to load `keys` from the pool, within the bound on
/// prefetches in flight. When it reports N leading blocks loaded, the cache mirror of that
/// engine (found again by URL) gets them. A 404 means the engine cannot prefetch: it is not
/// asked again. Every attempt is counted by outcome.
fn prefetch(shared: &Arc<Shared>, url: String, keys: Vec<BlockKey>) {
    let count = |outcome: &str| {
        shared
            .metrics
            .prefetches
            .with_label_values(&[outcome])
            .inc()
    };
    if shared.no_prefetch.lock().contains(&url) {
        count("skipped_unsupported");
        return;
    }
    let Some(permit) = shared.background_slot(&shared.metrics.prefetches) else {
        return;
    };
    let shared = shared.clone();
    tokio::spawn(async move {
        let _permit = permit;
        let target = engine_url(&url, PREFETCH_PATH);
        let body = prefetch_body(&keys);
        let outcome = match tokio::time::timeout(PREFETCH_TIMEOUT, async {
            let resp = shared.upstream.post(target.clone(), &body).await?;
            let status = resp.status();
            let bytes = read_body(target.clone(), resp.into_body()).await?;
            Ok::<_, UpstreamError>((status, bytes))
        })
        .await
        {
            Err(_) => {
                tracing::warn!(%url, "prefetch timed out");
                "timeout"
            }
            Ok(Err(e)) => {
                tracing::warn!(%url, error = %chain(&e),
                    "prefetch failed");
                "error"
            }
            Ok(Ok((StatusCode::NOT_FOUND, _))) => {
                tracing::info!(%url, "engine does not support prefetch; not asking it again");
                shared.no_prefetch.lock().insert(url.clone());
                "unsupported"
            }
            Ok(Ok((status, bytes))) if status.is_success() => {
                let loaded = serde_json::from_slice::<Value>(&bytes)
                    .ok()
                    .and_then(|v| v.get("loaded").and_then(Value::as_u64))
                    .map(|n| usize::try_from(n).unwrap_or(usize::MAX).min(keys.len()));
                match loaded {
                    Some(n) => {
                        let mut m = shared.members.lock();
                        let Members { engines, state, .. } = &mut *m;
                        if let (Some(i), Some(state)) = (
                            engines.prefill.iter().position(|u| *u == url),
                            state.as_mut(),
                        ) {
                            state.adopted(i, keys.get(..n).unwrap_or(&keys));
                        }
                        "ok"
                    }
                    None => {
                        tracing::warn!(%url, "prefetch answer lacks a numeric `loaded`");
                        "error"
                    }
                }
            }
            Ok(Ok((status, _))) => {
                tracing::warn!(%url, %status, "prefetch refused");
                "error"
            }
        };
        shared
            .metrics
            .prefetches
            .with_label_values(&[outcome])
            .inc();
    });
}
