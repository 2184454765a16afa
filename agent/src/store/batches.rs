//! The engine API served from the tiered store (local-only mode): [`TieredStore`] is the
//! API's [`BlockStore`]. Each batch runs on the blocking pool, because the store may touch the
//! SSD; a put copies each item out of the engine's staging area straight into its DRAM room, a
//! get copies the block into the staging area when it fits. I/O boundary: the staging files
//! (shared memory) and, through the store, the SSD tier's files.

use std::sync::Arc;

use super::{StoreError, TieredStore};
use crate::api::block_store::{Batch, BatchError, BlockStore};
use crate::api::shm::Staging;
use crate::proto::{GetItem, GetResult, PutItem, PutRequest, Status};

/// The per-item status of a failed store operation.
fn store_status(err: &StoreError) -> Status {
    match err {
        StoreError::BadKey(_) | StoreError::TooLarge { .. } => Status::Invalid,
        StoreError::NoSpace(_) => Status::NoSpace,
        StoreError::Ssd(_) => Status::Internal,
    }
}

/// Run `f` on the blocking pool.
fn blocking<T: Send + 'static>(f: impl FnOnce() -> Vec<T> + Send + 'static) -> Batch<T> {
    Box::pin(async move {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| BatchError::Worker(e.to_string()))
    })
}

impl TieredStore {
    /// Count a failed store operation and give its item status.
    fn failed(&self, e: &StoreError) -> Status {
        self.metrics.errors.with_label_values(&[e.category()]).inc();
        store_status(e)
    }

    fn put_item(&self, staging: &Staging, item: &PutItem, numa_hint: Option<u32>) -> Status {
        if !staging.contains(item.offset, item.length) {
            return Status::Invalid;
        }
        let mut copy_err = None;
        let res = self.put_with(&item.key, item.length, numa_hint, |dst| {
            copy_err = staging.read_into(item.offset, dst).err();
        });
        match (res, copy_err) {
            (Ok(()), None) => Status::Ok,
            (Ok(()), Some(_)) => {
                let _ = self.remove(&item.key);
                Status::Invalid
            }
            (Err(e), _) => self.failed(&e),
        }
    }

    fn get_item(&self, staging: &Staging, item: &GetItem) -> GetResult {
        let result = |status: Status, length: u64| GetResult {
            status: status as i32,
            length,
        };
        if !staging.contains(item.offset, item.capacity) {
            return result(Status::Invalid, 0);
        }
        let got = self.get_with(&item.key, |bytes| {
            let len = bytes.len() as u64;
            if len > item.capacity {
                return result(Status::BufferTooSmall, len);
            }
            match staging.write_from(item.offset, bytes) {
                Ok(()) => result(Status::Ok, len),
                Err(_) => result(Status::Invalid, 0),
            }
        });
        match got {
            Ok(Some((r, _))) => r,
            Ok(None) => result(Status::NotFound, 0),
            Err(e) => result(self.failed(&e), 0),
        }
    }
}

impl BlockStore for TieredStore {
    fn put_batch(self: Arc<Self>, staging: Arc<Staging>, req: PutRequest) -> Batch<i32> {
        blocking(move || {
            req.items
                .iter()
                .map(|item| self.put_item(&staging, item, req.numa_hint) as i32)
                .collect()
        })
    }

    fn get_batch(self: Arc<Self>, staging: Arc<Staging>, items: Vec<GetItem>) -> Batch<GetResult> {
        blocking(move || {
            items
                .iter()
                .map(|item| self.get_item(&staging, item))
                .collect()
        })
    }

    fn exists_batch(self: Arc<Self>, keys: Vec<Vec<u8>>) -> Batch<bool> {
        blocking(move || keys.iter().map(|k| self.exists(k)).collect())
    }

    fn remove_batch(self: Arc<Self>, keys: Vec<Vec<u8>>) -> Batch<bool> {
        blocking(move || {
            keys.iter()
                .map(|k| self.remove(k).unwrap_or(false))
                .collect()
        })
    }
}
