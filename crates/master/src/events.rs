//! The pool's block events on ZMQ, in vLLM's KV event format, for consumers that index the
//! pool as one more cache tier (llm-d, NVIDIA Dynamo): the leader drains the core's outbox of
//! [`PoolEvent`]s every few milliseconds, turns them into `BlockStored` / `BlockRemoved` /
//! `AllBlocksCleared` events (medium `cpu` for the DRAM tier, `disk` for SSD) and publishes
//! them through the shared publisher of `kvpool_runtime::kv_events`. A standby publishes
//! nothing; a new leader's first drain is a snapshot. I/O boundary: the publisher's sockets.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvpool_core::master::state::{EventName, PoolEvent};
use kvpool_core::master::types::Tier;
use kvpool_proto::kv_events::{Encoding, EventBatch, KvEvent, WireHash, encode_batch};
use kvpool_runtime::kv_events::{KvEventsConfig, KvEventsError, Publisher};
use tokio_util::sync::CancellationToken;

use crate::service::Core;

/// How often the outbox is drained.
const TICK: Duration = Duration::from_millis(5);
/// Events per published batch at most (a snapshot of a large pool spans many batches).
pub const EVENTS_PER_BATCH: usize = 1024;

/// What `--kv-events-config` and `--kv-events-block-size` set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolEventsConfig {
    pub kv: KvEventsConfig,
    /// Tokens per block, published in every `BlockStored`.
    pub block_size: u32,
}

/// vLLM's medium name of a tier.
pub fn medium(tier: Tier) -> &'static str {
    match tier {
        Tier::Dram => "cpu",
        Tier::Ssd => "disk",
    }
}

fn wire(name: EventName) -> WireHash {
    match name {
        EventName::Int(v) => WireHash::Int(v),
        EventName::Bytes(b) => WireHash::Bytes(b),
    }
}

/// The vLLM events of `events`, at most [`EVENTS_PER_BATCH`] per batch: one `BlockStored`
/// per object (pool objects are not a chain, so each stands alone without a parent), and
/// consecutive removals from one tier grouped into one `BlockRemoved`.
pub fn batches(events: Vec<PoolEvent>, block_size: u32) -> Vec<Vec<KvEvent>> {
    let mut out: Vec<KvEvent> = Vec::new();
    for e in events {
        match e {
            PoolEvent::Cleared => out.push(KvEvent::AllBlocksCleared),
            PoolEvent::Stored { tier, name } => out.push(KvEvent::BlockStored {
                block_hashes: vec![wire(name)],
                parent: None,
                token_ids: Vec::new(),
                block_size,
                lora_id: None,
                lora_name: None,
                medium: Some(medium(tier).into()),
                group_idx: None,
            }),
            PoolEvent::Removed { tier, name } => {
                if let Some(KvEvent::BlockRemoved {
                    block_hashes,
                    medium: Some(m),
                    ..
                }) = out.last_mut()
                    && m == medium(tier)
                    && block_hashes.len() < EVENTS_PER_BATCH
                {
                    block_hashes.push(wire(name));
                    continue;
                }
                out.push(KvEvent::BlockRemoved {
                    block_hashes: vec![wire(name)],
                    medium: Some(medium(tier).into()),
                    group_idx: None,
                });
            }
        }
    }
    let mut batches = Vec::new();
    let mut rest = out.into_iter().peekable();
    while rest.peek().is_some() {
        batches.push(rest.by_ref().take(EVENTS_PER_BATCH).collect());
    }
    batches
}

/// Counts per kind for the metrics: blocks stored, blocks removed, clears.
fn kinds(events: &[KvEvent]) -> [(&'static str, u64); 3] {
    let mut n = [0u64; 3];
    for e in events {
        match e {
            KvEvent::BlockStored { block_hashes, .. } => n[0] += block_hashes.len() as u64,
            KvEvent::BlockRemoved { block_hashes, .. } => n[1] += block_hashes.len() as u64,
            KvEvent::AllBlocksCleared => n[2] += 1,
        }
    }
    [
        ("block_stored", n[0]),
        ("block_removed", n[1]),
        ("all_blocks_cleared", n[2]),
    ]
}

/// Turns pool events on in `core`'s state (before a standby's first leadership, so the state a
/// new leader builds keeps them), binds the sockets, and publishes until `stop` fires.
pub async fn start(
    core: Arc<Core>,
    config: PoolEventsConfig,
    outbox_cap: usize,
    stop: CancellationToken,
) -> Result<(), KvEventsError> {
    core.state.lock().enable_pool_events(outbox_cap);
    let publisher = Publisher::bind(config.kv).await?;
    let block_size = config.block_size;
    let next = move || {
        if !core.role.is_leader() {
            return Vec::new();
        }
        let drain = core.state.lock().take_pool_events();
        if drain.resync {
            core.metrics.kv_event_resync();
            if drain.overflowed {
                tracing::warn!("pool event outbox overflowed; publishing a snapshot");
            }
        }
        batches(drain.events, block_size)
            .into_iter()
            .map(|events| {
                core.metrics.kv_event_batch(&kinds(&events));
                Bytes::from(encode_batch(&EventBatch::now(events), Encoding::Array))
            })
            .collect()
    };
    tokio::spawn(publisher.run(TICK, next, stop));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_events_become_vllm_events_in_bounded_batches() {
        let stored = |i: u64, tier| PoolEvent::Stored {
            tier,
            name: EventName::Int(i),
        };
        let removed = |i: u64, tier| PoolEvent::Removed {
            tier,
            name: EventName::Int(i),
        };
        let out = batches(
            vec![
                PoolEvent::Cleared,
                stored(1, Tier::Dram),
                PoolEvent::Stored {
                    tier: Tier::Ssd,
                    name: EventName::Bytes(b"k".to_vec()),
                },
                removed(1, Tier::Dram),
                removed(2, Tier::Dram),
                removed(3, Tier::Ssd),
            ],
            16,
        );
        assert_eq!(out.len(), 1);
        let b = &out[0];
        assert_eq!(b.len(), 5);
        assert_eq!(b[0], KvEvent::AllBlocksCleared);
        assert!(
            matches!(&b[1], KvEvent::BlockStored { block_hashes, medium: Some(m), block_size: 16, parent: None, .. }
            if block_hashes == &[WireHash::Int(1)] && m == "cpu")
        );
        assert!(
            matches!(&b[2], KvEvent::BlockStored { block_hashes, medium: Some(m), .. }
            if block_hashes == &[WireHash::Bytes(b"k".to_vec())] && m == "disk")
        );
        assert!(
            matches!(&b[3], KvEvent::BlockRemoved { block_hashes, medium: Some(m), .. }
            if block_hashes == &[WireHash::Int(1), WireHash::Int(2)] && m == "cpu")
        );
        assert!(
            matches!(&b[4], KvEvent::BlockRemoved { block_hashes, medium: Some(m), .. }
            if block_hashes == &[WireHash::Int(3)] && m == "disk")
        );
        assert_eq!(
            kinds(b),
            [
                ("block_stored", 2),
                ("block_removed", 3),
                ("all_blocks_cleared", 1)
            ]
        );
        let many = batches((0..2500).map(|i| stored(i, Tier::Dram)).collect(), 16);
        assert_eq!(
            many.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![1024, 1024, 452]
        );
        assert!(batches(Vec::new(), 16).is_empty());
    }
}
