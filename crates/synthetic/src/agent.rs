//! The synthetic engine's KV blocks in the node agent: which blocks the pool has, reading them
//! back (every byte checked against the key-derived contents) and writing new ones, in batches
//! through one engine-API session. I/O boundary: the agent's Unix socket and the staging file.

use std::path::Path;

use tokio::sync::Mutex;

use super::kv::{self, KvGeometry};
use kvpool_client::engine_api::client::{ClientError, EngineClient, GetOutcome};
use kvpool_core::sched::BlockKey;
use kvpool_proto::engine_api::Status;

/// Most staging memory one engine asks for.
const MAX_STAGING_BYTES: u64 = 64 << 20;
/// Most blocks in one put or get batch.
const MAX_BATCH_BLOCKS: u64 = 256;

/// Errors of talking to the agent.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum AgentKvError {
    #[error("KV block of {block_bytes} bytes does not fit the largest staging area ({max} bytes)")]
    BlockTooLarge { block_bytes: u64, max: u64 },
    #[error("cannot open an engine-API session with the agent")]
    Connect(#[source] ClientError),
    #[error("engine-API batch {op} failed")]
    Batch {
        op: &'static str,
        #[source]
        source: ClientError,
    },
}

kvpool_runtime::error_category!(AgentKvError);

/// What a read of a run of blocks found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadOutcome {
    /// Leading blocks read and verified (the usable prefix).
    pub verified: usize,
    /// Blocks the agent did not have (reading stops at the first).
    pub missing: usize,
    /// Blocks whose bytes or length did not match their key (reading stops at the first).
    pub corrupt: usize,
    /// Bytes copied out of the agent.
    pub bytes: u64,
}

/// What a write of blocks did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteOutcome {
    pub written: usize,
    /// Blocks the agent refused (no space, invalid...).
    pub refused: usize,
    pub bytes: u64,
}

/// One engine's session with its node agent.
#[derive(Debug)]
pub struct AgentKv {
    client: Mutex<EngineClient>,
    geometry: KvGeometry,
    model: String,
    batch_blocks: usize,
}

impl AgentKv {
    /// Connects to the agent at `socket` with a staging area for a batch of blocks.
    pub async fn connect(
        socket: &Path,
        geometry: KvGeometry,
        model: &str,
    ) -> Result<Self, AgentKvError> {
        let block_bytes = geometry.block_bytes();
        if block_bytes == 0 || block_bytes > MAX_STAGING_BYTES {
            return Err(AgentKvError::BlockTooLarge {
                block_bytes,
                max: MAX_STAGING_BYTES,
            });
        }
        let batch = (MAX_STAGING_BYTES / block_bytes).clamp(1, MAX_BATCH_BLOCKS);
        let client = EngineClient::connect(socket, batch * block_bytes, "kvpool-synthetic")
            .await
            .map_err(AgentKvError::Connect)?;
        Ok(Self {
            client: Mutex::new(client),
            geometry,
            model: model.to_owned(),
            batch_blocks: usize::try_from(batch).unwrap_or(1),
        })
    }

    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }

    /// The block size and a buffer of one block.
    fn block_buffer(&self) -> (u64, Vec<u8>) {
        let block = self.geometry.block_bytes();
        (block, vec![0u8; usize::try_from(block).unwrap_or(0)])
    }

    /// `keys` in batches of blocks that fit the staging area together.
    fn batches<'k>(&self, keys: &'k [BlockKey]) -> std::slice::Chunks<'k, BlockKey> {
        keys.chunks(self.batch_blocks.max(1))
    }

    /// The pool object names of `keys`, in order.
    fn names(&self, keys: &[BlockKey]) -> Vec<Vec<u8>> {
        keys.iter().map(|&k| kv::pool_key(&self.model, k)).collect()
    }

    /// Which of `keys` the agent holds.
    pub async fn present(&self, keys: &[BlockKey]) -> Result<Vec<bool>, AgentKvError> {
        let names = self.names(keys);
        let refs: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
        let mut out = Vec::with_capacity(keys.len());
        let mut client = self.client.lock().await;
        for chunk in refs.chunks(self.batch_blocks.max(1) * 16) {
            let present = client
                .exists(chunk)
                .await
                .map_err(|source| AgentKvError::Batch {
                    op: "exists",
                    source,
                })?;
            if present.len() != chunk.len() {
                return Err(AgentKvError::Batch {
                    op: "exists",
                    source: ClientError::Mismatch {
                        sent: chunk.len(),
                        got: present.len(),
                    },
                });
            }
            out.extend(present);
        }
        Ok(out)
    }

    /// Reads `keys` in order and checks every block; stops at the first block that is missing
    /// or wrong, because KV after a gap is of no use to the engine.
    pub async fn read_prefix(&self, keys: &[BlockKey]) -> Result<ReadOutcome, AgentKvError> {
        let (block, mut buf) = self.block_buffer();
        let mut outcome = ReadOutcome::default();
        let mut client = self.client.lock().await;
        for chunk in self.batches(keys) {
            let names = self.names(chunk);
            let items = staged_items(&names, block);
            let results = client
                .get_batch(&items)
                .await
                .map_err(|source| AgentKvError::Batch { op: "get", source })?;
            for (i, (&key, result)) in chunk.iter().zip(&results).enumerate() {
                match result {
                    GetOutcome {
                        status: Status::Ok,
                        length,
                    } => {
                        outcome.bytes += length;
                        let ok = *length == block
                            && client
                                .staging()
                                .read_into(i as u64 * block, &mut buf)
                                .is_ok()
                            && kv::verify_block(key, &buf, block);
                        if !ok {
                            outcome.corrupt += 1;
                            return Ok(outcome);
                        }
                        outcome.verified += 1;
                    }
                    GetOutcome {
                        status: Status::BufferTooSmall,
                        ..
                    } => {
                        outcome.corrupt += 1;
                        return Ok(outcome);
                    }
                    _ => {
                        outcome.missing += 1;
                        return Ok(outcome);
                    }
                }
            }
        }
        Ok(outcome)
    }

    /// Removes `keys` from the pool (hand-off markers once read); returns how many were there.
    pub async fn remove(&self, keys: &[BlockKey]) -> Result<usize, AgentKvError> {
        let names = self.names(keys);
        let refs: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
        let removed = self
            .client
            .lock()
            .await
            .remove(&refs)
            .await
            .map_err(|source| AgentKvError::Batch {
                op: "remove",
                source,
            })?;
        Ok(removed.into_iter().filter(|&r| r).count())
    }

    /// Writes the key-derived contents of `keys`.
    pub async fn write(&self, keys: &[BlockKey]) -> Result<WriteOutcome, AgentKvError> {
        let (block, mut buf) = self.block_buffer();
        let mut outcome = WriteOutcome::default();
        let mut client = self.client.lock().await;
        for chunk in self.batches(keys) {
            let names = self.names(chunk);
            for (i, &key) in chunk.iter().enumerate() {
                kv::fill_block(key, &mut buf);
                client
                    .staging()
                    .write_from(i as u64 * block, &buf)
                    .map_err(|e| AgentKvError::Batch {
                        op: "put",
                        source: ClientError::Staging(e),
                    })?;
            }
            let items = staged_items(&names, block);
            let statuses = client
                .put_batch(&items, None)
                .await
                .map_err(|source| AgentKvError::Batch { op: "put", source })?;
            for status in statuses {
                if status == Status::Ok {
                    outcome.written += 1;
                    outcome.bytes += block;
                } else {
                    outcome.refused += 1;
                }
            }
        }
        Ok(outcome)
    }
}

/// Batch items for `names` staged one block after another: (name, staging offset, length).
fn staged_items(names: &[Vec<u8>], block: u64) -> Vec<(&[u8], u64, u64)> {
    names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_slice(), i as u64 * block, block))
        .collect()
}
