//! The get path: locate the value at the master (taking a read lease), read the nearest
//! replica (a memory copy when it lives in this process), falling back to the others, and
//! release the lease in the background; a read that may have outlived its lease is discarded.
//! A value that is a striped object's manifest goes on to `striped`. I/O boundary: the
//! master's gRPC channel and the transfer engine's connections.

use super::PoolClient;
use super::error::DataError;
use super::local::copy_local;
use super::manifest::{MANIFEST_LEN, Manifest};
use super::transport::check_length;
use crate::master::pick_nearest;
use futures::future::BoxFuture;
use kvpool_core::master::types::ReplicaInfo;
use kvpool_transfer::{self as transfer, MemoryError, TransferOp};

/// Where a read lands.
#[derive(Clone)]
pub(super) enum Dest {
    /// A (reused) staging buffer of the client, at offset 0.
    Staging,
    /// A caller's registered buffer, at this offset, with room for this many bytes.
    Buffer(transfer::LocalSegment, u64, u64),
}

impl Dest {
    pub(super) fn check_fits(&self, size: u64) -> Result<(), DataError> {
        match self {
            Dest::Staging => Ok(()),
            Dest::Buffer(_, _, have) => {
                let have = *have;
                if size > have {
                    Err(DataError::BufferTooSmall { size, have })
                } else {
                    Ok(())
                }
            }
        }
    }
}

/// A value read by [`PoolClient::read_value`].
enum Value {
    Plain {
        size: u64,
        local: transfer::LocalSegment,
    },
    /// The manifest of a striped object.
    Striped(Manifest),
}

impl PoolClient {
    /// Read a value: locate it (taking a read lease), read the nearest replica, trying the
    /// others if it fails, then release the lease in the background.
    pub async fn get(&self, key: &[u8]) -> Result<Vec<u8>, DataError> {
        let mut out = Vec::new();
        self.get_with(key, |size| {
            // The size comes from the master: bound it before allocating.
            let n = usize::try_from(size)
                .ok()
                .filter(|n| *n <= transfer::memory::MAX_SEGMENT_SIZE)
                .ok_or(DataError::Staging {
                    size,
                    source: MemoryError::InvalidSize {
                        size: usize::try_from(size).unwrap_or(usize::MAX),
                        max: transfer::memory::MAX_SEGMENT_SIZE,
                    },
                })?;
            out = vec![0u8; n];
            Ok(out.as_mut_slice())
        })
        .await?;
        Ok(out)
    }

    /// Read a value into `buf` (which must be at least as long as the value); returns its
    /// length. Saves the allocation of [`Self::get`] when a caller reuses its buffer; the
    /// bytes still pass through a staging buffer ([`Self::get_to`] avoids that copy).
    pub async fn get_into(&self, key: &[u8], buf: &mut [u8]) -> Result<usize, DataError> {
        let have = buf.len() as u64;
        self.get_with(key, move |size| {
            let n = usize::try_from(size)
                .ok()
                .filter(|n| *n <= buf.len())
                .ok_or(DataError::BufferTooSmall { size, have })?;
            buf.get_mut(..n)
                .ok_or(DataError::BufferTooSmall { size, have })
        })
        .await
    }

    /// Zero-copy get: read a value straight into `buffer` (registered with this client's
    /// engine, see [`Self::register_buffer`]) at `offset`; returns its length. The transport
    /// receives into the buffer itself, with no staging copy. On error the bytes of the buffer
    /// after `offset` are unspecified.
    pub async fn get_to(
        &self,
        key: &[u8],
        buffer: &transfer::LocalSegment,
        offset: u64,
    ) -> Result<u64, DataError> {
        let room = buffer.len().saturating_sub(offset);
        self.get_to_within(key, buffer, offset, room).await
    }

    /// [`Self::get_to`] into the `capacity` bytes at `offset` of `buffer` only: a value larger
    /// than that fails with [`DataError::BufferTooSmall`] before any byte moves.
    pub async fn get_to_within(
        &self,
        key: &[u8],
        buffer: &transfer::LocalSegment,
        offset: u64,
        capacity: u64,
    ) -> Result<u64, DataError> {
        let room = buffer.len().saturating_sub(offset);
        let dest = Dest::Buffer(buffer.clone(), offset, capacity.min(room));
        match self.read_value(key, &dest).await? {
            Value::Plain { size, .. } => Ok(size),
            Value::Striped(m) => {
                dest.check_fits(m.total)?;
                self.get_striped(key, m, &dest).await.map(|_| m.total)
            }
        }
    }

    /// The size of the value of `key` (a striped object's whole size), without reading it
    /// unless it may be a striped object's manifest.
    pub async fn value_size(&self, key: &[u8]) -> Result<u64, DataError> {
        let located = self.master.get(key).await.map_err(DataError::Master)?;
        self.master.release_lease_later(located.lease_id);
        if located.size != MANIFEST_LEN as u64 {
            return Ok(located.size);
        }
        match self.read_value(key, &Dest::Staging).await? {
            Value::Plain { size, local } => {
                self.done_with(&Dest::Staging, local);
                Ok(size)
            }
            Value::Striped(m) => Ok(m.total),
        }
    }

    /// Read into staging, then copy into the slice `sink(size)` returns.
    async fn get_with<'b>(
        &self,
        key: &[u8],
        sink: impl FnOnce(u64) -> Result<&'b mut [u8], DataError>,
    ) -> Result<usize, DataError> {
        let (size, local) = match self.read_value(key, &Dest::Staging).await? {
            Value::Plain { size, local, .. } => (size, local),
            Value::Striped(m) => (m.total, self.get_striped(key, m, &Dest::Staging).await?),
        };
        self.unstage_into(local, size, sink(size))
    }

    /// Locate `key` and read its value into `dest`; the lease is released in the background.
    /// A value that is the manifest of `key` comes back as [`Value::Striped`] (its bytes
    /// dropped). Fails with [`DataError::LeaseExpired`] when the read ended after the lease
    /// may have run out: by then eviction may have given the memory to another object.
    /// Boxed out of line: compiled once here, not in each crate that awaits a get.
    #[inline(never)]
    fn read_value<'a>(
        &'a self,
        key: &'a [u8],
        dest: &'a Dest,
    ) -> BoxFuture<'a, Result<Value, DataError>> {
        Box::pin(async move {
            let located = self.master.get(key).await.map_err(DataError::Master)?;
            let size = located.size;
            if let Err(e) = dest.check_fits(size) {
                self.master.release_lease_later(located.lease_id);
                return Err(e);
            }
            let this = self.clone();
            let replicas = located.replicas.clone();
            let d = dest.clone();
            let read = self
                .blocking(move || this.read_any(size, &replicas, &d))
                .await;
            let held = located.lease_held();
            self.master.release_lease_later(located.lease_id);
            let (local, base) = read?;
            if !held {
                self.done_with(dest, local);
                return Err(DataError::LeaseExpired {
                    ttl: located.lease_ttl,
                });
            }
            if size == MANIFEST_LEN as u64 {
                let mut head = [0u8; MANIFEST_LEN];
                local
                    .segment()
                    .read_at(base, &mut head)
                    .map_err(|source| DataError::Staging { size, source })?;
                if let Some(m) = Manifest::decode(key, &head) {
                    self.done_with(dest, local);
                    return Ok(Value::Striped(m));
                }
            }
            Ok(Value::Plain { size, local })
        })
    }

    /// Give back a staging buffer (a caller's buffer stays with the caller).
    pub(super) fn done_with(&self, dest: &Dest, local: transfer::LocalSegment) {
        if matches!(dest, Dest::Staging) {
            self.unstage(local);
        }
    }

    /// Read a value of `size` bytes from `replicas` (nearest first) into a new vector.
    pub(super) fn read_vec_any(
        &self,
        size: u64,
        replicas: &[ReplicaInfo],
    ) -> Result<Vec<u8>, DataError> {
        let (local, _) = self.read_any(size, replicas, &Dest::Staging)?;
        let mut out = vec![0u8; usize::try_from(size).unwrap_or(0)];
        self.unstage_into(local, size, Ok(out.as_mut_slice()))?;
        Ok(out)
    }

    /// The buffer a read of `size` bytes lands in, and where in it.
    pub(super) fn destination(
        &self,
        dest: &Dest,
        size: u64,
    ) -> Result<(transfer::LocalSegment, u64), DataError> {
        match dest {
            Dest::Staging => Ok((self.staging(None, size)?, 0)),
            Dest::Buffer(b, off, _) => {
                dest.check_fits(size)?;
                Ok((b.clone(), *off))
            }
        }
    }

    /// Read `size` bytes from the nearest replica (then the others) into `dest`; returns the
    /// buffer and the offset of the value in it.
    fn read_any(
        &self,
        size: u64,
        replicas: &[ReplicaInfo],
        dest: &Dest,
    ) -> Result<(transfer::LocalSegment, u64), DataError> {
        let first = pick_nearest(replicas, &self.node, self.numa_node);
        let order = first.into_iter().chain(
            replicas
                .iter()
                .filter(|r| !first.is_some_and(|f| std::ptr::eq(f, *r))),
        );
        let mut last = DataError::NoReplica;
        for r in order {
            match self.read_one(size, r, dest) {
                Ok(v) => return Ok(v),
                Err(e) => {
                    tracing::warn!(node = %r.node, segment = %r.segment, error = %e,
                        "replica read failed, trying the next");
                    // A transfer abandoned unsettled may still land in a caller's buffer:
                    // never reuse it for another replica.
                    let unsettled = matches!(&e,
                        DataError::Transfer { source, .. } if source.index.is_none());
                    if unsettled && matches!(dest, Dest::Buffer(..)) {
                        return Err(e);
                    }
                    last = e;
                }
            }
        }
        Err(last)
    }

    fn read_one(
        &self,
        size: u64,
        r: &ReplicaInfo,
        dest: &Dest,
    ) -> Result<(transfer::LocalSegment, u64), DataError> {
        check_length(r, size)?;
        let (local, base) = self.destination(dest, size)?;
        if let Some(seg) = self.local_segment(r) {
            copy_local(&seg, r.offset, local.segment(), base, size, r)?;
            return Ok((local, base));
        }
        let request = self.request(TransferOp::Read, &local, base, r, size)?;
        let name = request.remote.name().to_owned();
        self.engine
            .transfer(vec![request])
            .map_err(|source| DataError::Transfer { name, source })?;
        Ok((local, base))
    }

    #[cfg(test)]
    pub(super) fn read_vec(
        &self,
        size: u64,
        replicas: &[ReplicaInfo],
    ) -> Result<Vec<u8>, DataError> {
        self.read_vec_any(size, replicas)
    }
}
