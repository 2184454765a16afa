//! A request's KV blocks in the pool, through the node agent: loading what the pool holds of
//! the prompt beyond the local cache (every byte verified), and writing the blocks it lacked
//! after prefill; each call timed and counted. I/O boundary: the agent's session (`AgentKv`).

use super::shared::Shared;
use crate::agent::AgentKv;
use kvpool_core::sched::BlockKey;
use kvpool_proto::openai::KvRole;
use kvpool_runtime::telemetry::chain;

/// Loads what the pool has of the prompt's full blocks beyond the local cache; returns how many
/// leading blocks are now available (0 when the local cache covers more) and the blocks to write
/// after prefill (absent from the pool; none for a decode engine).
pub(super) async fn load_from_pool(
    shared: &Shared,
    kv: &AgentKv,
    role: KvRole,
    keys: &[BlockKey],
) -> (usize, Vec<BlockKey>) {
    let m = &shared.metrics;
    let local = shared.core.lock().local_prefix(keys);
    let (pool_prefix, to_write) = if role == KvRole::Decode {
        // The prefill engine wrote them: read without asking first.
        (keys.len(), Vec::new())
    } else {
        let timer = m.kv_seconds.with_label_values(&["exists"]).start_timer();
        let present = kv.present(keys).await;
        timer.observe_duration();
        match present {
            Ok(present) => {
                let prefix = present.iter().take_while(|&&p| p).count();
                let absent = keys
                    .iter()
                    .zip(&present)
                    .filter(|(_, p)| !**p)
                    .map(|(&k, _)| k)
                    .collect();
                (prefix, absent)
            }
            Err(e) => {
                m.kv_error(&e);
                tracing::warn!(error = %chain(&e), "cannot ask the agent which blocks it has");
                (0, Vec::new())
            }
        }
    };
    let mut loaded = 0;
    if pool_prefix > local {
        let timer = m.kv_seconds.with_label_values(&["read"]).start_timer();
        let read = kv.read_prefix(&keys[local..pool_prefix]).await;
        timer.observe_duration();
        match read {
            Ok(read) => {
                m.kv_read(&read);
                if read.corrupt > 0 {
                    tracing::warn!(
                        block = local + read.verified,
                        "KV block read back from the agent does not match its key"
                    );
                }
                if read.verified > 0 {
                    loaded = local + read.verified;
                }
            }
            Err(e) => {
                m.kv_error(&e);
                tracing::warn!(error = %chain(&e), "cannot read KV blocks from the agent");
            }
        }
    }
    let have = local.max(loaded);
    m.kv_block_misses.inc_by((keys.len() - have) as u64);
    (loaded, to_write)
}

/// Writes the key-derived contents of `keys` to the pool (nothing for none); failures are
/// counted and logged, the request goes on.
pub(super) async fn store_in_pool(shared: &Shared, kv: &AgentKv, keys: &[BlockKey]) {
    if keys.is_empty() {
        return;
    }
    let m = &shared.metrics;
    let timer = m.kv_seconds.with_label_values(&["write"]).start_timer();
    let written = kv.write(keys).await;
    timer.observe_duration();
    match written {
        Ok(w) => {
            m.kv_written_bytes.inc_by(w.bytes);
            m.kv_blocks_written.inc_by(w.written as u64);
            if w.refused > 0 {
                m.kv_errors
                    .with_label_values(&["refused"])
                    .inc_by(w.refused as u64);
            }
        }
        Err(e) => {
            m.kv_error(&e);
            tracing::warn!(error = %chain(&e), "cannot write KV blocks to the agent");
        }
    }
}
