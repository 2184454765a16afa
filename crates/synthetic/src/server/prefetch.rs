//! `POST /kvpool/v1/prefetch`: the conductor's hot-prefix replication asks this engine to read
//! named blocks from the pool into its prefix cache ahead of the requests that will want them.
//! I/O boundary: the node agent.

use kvpool_runtime::telemetry::chain;
use std::sync::Arc;

use axum::body::Bytes;
use axum::response::{IntoResponse, Json, Response};

use super::error_bodies::{agent_failed, api_error, prefetch_unsupported};
use super::shared::Shared;
use kvpool_proto::prefetch::parse_prefetch;

/// `POST /kvpool/v1/prefetch`: reads the named blocks beyond the local cache from the pool,
/// verifying every byte, and caches the leading ones that arrived whole. Without an agent there
/// is no pool to read: 404, which tells the conductor to stop asking.
pub(super) async fn prefetch(shared: Arc<Shared>, body: Bytes) -> Response {
    let m = &shared.metrics;
    let Some(kv) = &shared.kv else {
        m.prefetches.with_label_values(&["unsupported"]).inc();
        return prefetch_unsupported();
    };
    let keys = match parse_prefetch(&body) {
        Ok(k) => k,
        Err(e) => {
            m.prefetches.with_label_values(&["invalid"]).inc();
            return api_error(&shared, &e);
        }
    };
    let local = shared.core.lock().local_prefix(&keys);
    let mut held = local;
    if let Some(rest) = keys.get(local..).filter(|r| !r.is_empty()) {
        match kv.read_prefix(rest).await {
            Ok(read) => {
                m.kv_read(&read);
                held += read.verified;
            }
            Err(e) => {
                m.kv_error(&e);
                m.prefetches.with_label_values(&["error"]).inc();
                tracing::warn!(error = %chain(&e), "prefetch: cannot read KV blocks from the agent");
                return agent_failed(&e);
            }
        }
    }
    let loaded = keys.get(..held).unwrap_or(&keys);
    shared.core.lock().adopt(loaded);
    m.prefetches.with_label_values(&["ok"]).inc();
    Json(serde_json::json!({"loaded": held})).into_response()
}
