//! The put path: allocate replicas at the master, write the value to every one (a memory copy
//! for replicas in this process, one transfer batch for the others), then commit; a failed
//! write revokes the put. Values above the stripe threshold go to `striped`. I/O boundary: the
//! master's gRPC channel and the transfer engine's connections.

use super::PoolClient;
use super::error::DataError;
use super::local::{copy_local, local_error};
use super::manifest::Manifest;
use super::naming::replica_names;
use super::transport::check_length;
use futures::future::BoxFuture;
use kvpool_core::master::types::{PutOptions, PutStarted, ReplicaInfo};
use kvpool_transfer::{self as transfer, TransferOp};

/// Where a put's bytes come from.
#[derive(Clone)]
pub(super) enum Source<'a> {
    /// Caller memory, copied into a staging buffer.
    Bytes(&'a [u8]),
    /// A registered buffer, offset and length: written from directly.
    Registered(transfer::LocalSegment, u64, u64),
}

impl Source<'_> {
    pub(super) fn len(&self) -> u64 {
        match self {
            Source::Bytes(v) => v.len() as u64,
            Source::Registered(_, _, len) => *len,
        }
    }
}

/// Attempts of one put, the first included, when replica holders are unreachable.
const PUT_ATTEMPTS: usize = 3;

/// A failed attempt of a put, and the node that could not be reached, when one could not.
struct PutFailed {
    error: DataError,
    unreachable: Option<String>,
}

/// Whether a transfer failure says the peer could not be reached or went away (connection
/// refused, reset or closed, a handshake or the batch timing out), as opposed to a fault on this
/// side (`local_memory`: a caller's buffer no longer mapped) or an answer of the peer.
pub(super) fn peer_unreachable(f: &kvpool_transfer::Failure) -> bool {
    matches!(
        f.category,
        "connect" | "handshake" | "closed" | "timeout" | "open" | "io"
    )
}

impl From<DataError> for PutFailed {
    fn from(error: DataError) -> Self {
        PutFailed {
            error,
            unreachable: None,
        }
    }
}

impl PoolClient {
    /// Write `value` to every replica the master allocates, then commit. A failed write
    /// revokes the put. Returns the replicas written (empty when the key was already committed).
    /// The value is copied once into a (reused) registered staging buffer; [`Self::put_from`]
    /// avoids that copy.
    pub async fn put(
        &self,
        key: &[u8],
        value: &[u8],
        opts: &PutOptions,
    ) -> Result<Vec<ReplicaInfo>, DataError> {
        self.put_source(key, Source::Bytes(value), opts).await
    }

    /// Zero-copy put: write `len` bytes at `offset` of a buffer registered with this client's
    /// engine (see [`Self::register_buffer`]) to every replica, then commit. The buffer must
    /// not change until this returns.
    pub async fn put_from(
        &self,
        key: &[u8],
        buffer: &transfer::LocalSegment,
        offset: u64,
        len: u64,
        opts: &PutOptions,
    ) -> Result<Vec<ReplicaInfo>, DataError> {
        buffer
            .segment()
            .check_range(offset, len)
            .map_err(|source| DataError::Staging { size: len, source })?;
        self.put_source(key, Source::Registered(buffer.clone(), offset, len), opts)
            .await
    }

    /// Boxed, and kept out of line, so that the put path is compiled once, in this crate,
    /// rather than in every crate that awaits a put (docs/adr/0003-crates-by-layer.md,
    /// "Futures across crates").
    #[inline(never)]
    fn put_source<'a>(
        &'a self,
        key: &'a [u8],
        source: Source<'a>,
        opts: &'a PutOptions,
    ) -> BoxFuture<'a, Result<Vec<ReplicaInfo>, DataError>> {
        Box::pin(async move {
            match self.striped_as(source.len()) {
                Some(m) => self.put_striped(key, source, m, opts).await,
                None => self.put_plain(key, source, opts).await,
            }
        })
    }

    /// The manifest of a value of `size` bytes when it is striped (see [`StripeConfig`]).
    ///
    /// [`StripeConfig`]: super::StripeConfig
    pub(super) fn striped_as(&self, size: u64) -> Option<Manifest> {
        if size > self.stripe.threshold && self.stripe.part_size < size {
            Manifest::new(size, self.stripe.part_size)
        } else {
            None
        }
    }

    /// A put that rides out an unreachable replica holder: when a replica's write fails
    /// and the failing node is known, the put is revoked and placed again without that node
    /// (which the master then avoids for every writer until it is heard from again), at most
    /// [`PUT_ATTEMPTS`] times in all.
    pub(super) async fn put_plain(
        &self,
        key: &[u8],
        source: Source<'_>,
        opts: &PutOptions,
    ) -> Result<Vec<ReplicaInfo>, DataError> {
        let mut opts = std::borrow::Cow::Borrowed(opts);
        let mut attempt = 1;
        loop {
            match self.put_plain_once(key, source.clone(), &opts).await {
                Err(PutFailed {
                    error,
                    unreachable: Some(node),
                }) if attempt < PUT_ATTEMPTS => {
                    tracing::debug!(%node, error = %error, attempt,
                        "a replica holder was unreachable; placing the put again without it");
                    opts.to_mut().avoid_nodes.push(node);
                    attempt += 1;
                }
                Err(failed) => return Err(failed.error),
                Ok(replicas) => return Ok(replicas),
            }
        }
    }

    async fn put_plain_once(
        &self,
        key: &[u8],
        source: Source<'_>,
        opts: &PutOptions,
    ) -> Result<Vec<ReplicaInfo>, PutFailed> {
        let size = source.len();
        let started = self
            .master
            .put_start(key, size, opts)
            .await
            .map_err(|e| PutFailed::from(DataError::Master(e)))?;
        let (put_id, replicas) = match started {
            PutStarted::AlreadyCommitted { .. } => return Ok(Vec::new()),
            PutStarted::Allocated { put_id, replicas } => (put_id, replicas),
        };
        if let Source::Bytes(value) = &source {
            match self.write_all_local(value, &replicas) {
                Ok(true) => {
                    self.master
                        .put_end(key, put_id)
                        .await
                        .map_err(|e| PutFailed::from(DataError::Master(e)))?;
                    return Ok(replicas);
                }
                Ok(false) => {}
                Err(e) => {
                    // Only copies within this process, finished: nothing is on its way.
                    self.revoke_unsent(&[(key, put_id)]).await;
                    return Err(e.into());
                }
            }
        }
        let targets = replicas.clone();
        let written = self
            .write_staged(source, move |this, local, offset| {
                this.write_from(local, offset, size, &targets)
            })
            .await;
        if let Err(error) = written {
            self.revoke(key, put_id).await;
            let unreachable = self.failed_node(&error, &replicas);
            return Err(PutFailed { error, unreachable });
        }
        self.master
            .put_end(key, put_id)
            .await
            .map_err(|e| PutFailed::from(DataError::Master(e)))?;
        Ok(replicas)
    }

    /// The node whose replica's write failed with `error`, when the transfer says which (the
    /// remote replicas are written in `replicas`' order, local ones copied in place).
    fn failed_node(&self, error: &DataError, replicas: &[ReplicaInfo]) -> Option<String> {
        let source = match error {
            DataError::Transfer { source, .. } => source,
            // The replica's segment could not be opened (its agent does not answer).
            DataError::Open { name, .. } => {
                return replicas
                    .iter()
                    .find(|r| super::naming::replica_name(r) == *name)
                    .map(|r| r.node.clone());
            }
            DataError::NoEndpoint { node, .. } => return Some(node.clone()),
            _ => return None,
        };
        if !peer_unreachable(&source.failure) {
            // Our own side failed (a caller buffer gone, EFAULT): placing elsewhere won't help,
            // and the node did nothing wrong.
            return None;
        }
        let mut remote = replicas.iter().filter(|r| self.local_segment(r).is_none());
        match source.index {
            Some(i) => remote.nth(i).map(|r| r.node.clone()),
            None => {
                let only = remote.next()?;
                remote.next().is_none().then(|| only.node.clone())
            }
        }
    }

    /// Revoke puts of which no byte was sent (a failed revoke is logged: the puts time out).
    pub(super) async fn revoke_unsent(&self, items: &[(&[u8], u64)]) {
        let failed = match self.master.put_revoke_unsent(items).await {
            Ok(results) => results.into_iter().find_map(Result::err),
            Err(e) => Some(e),
        };
        if let Some(revoke) = failed {
            tracing::warn!(error = %revoke, "revoking an unsent put failed");
        }
    }

    /// Revoke a put whose write failed (a failed revoke is logged: the put times out).
    async fn revoke(&self, key: &[u8], put_id: u64) {
        if let Err(revoke) = self.master.put_revoke(key, put_id).await {
            tracing::warn!(error = %revoke, "revoking a failed put failed");
        }
    }

    /// Send a put's bytes with `write(client, buffer, offset)` from the blocking pool: staged
    /// first (one copy into registered memory) unless the caller's buffer is registered
    /// already. A staging buffer is given back only after a write that succeeded.
    pub(super) async fn write_staged(
        &self,
        source: Source<'_>,
        write: impl FnOnce(&PoolClient, &transfer::LocalSegment, u64) -> Result<(), DataError>
        + Send
        + 'static,
    ) -> Result<(), DataError> {
        let size = source.len();
        let (local, offset, staged) = match source {
            Source::Bytes(value) => (self.staging(Some(value), size)?, 0, true),
            Source::Registered(buf, offset, _) => (buf, offset, false),
        };
        let this = self.clone();
        self.blocking(move || {
            write(&this, &local, offset)?;
            if staged {
                this.unstage(local);
            }
            Ok(())
        })
        .await
    }

    /// Copy `value` straight into every replica when all of them live in this process (no
    /// staging, no transport). False when some replica needs the transport.
    pub(super) fn write_all_local(
        &self,
        value: &[u8],
        replicas: &[ReplicaInfo],
    ) -> Result<bool, DataError> {
        let size = value.len() as u64;
        let mut segs = Vec::with_capacity(replicas.len());
        for r in replicas {
            check_length(r, size)?;
            match self.local_segment(r) {
                Some(seg) => segs.push((seg, r)),
                None => return Ok(false),
            }
        }
        for (seg, r) in segs {
            seg.write_at(r.offset, value).map_err(local_error(r))?;
        }
        Ok(true)
    }

    #[cfg(test)]
    pub(super) fn write_replicas(
        &self,
        value: &[u8],
        replicas: &[ReplicaInfo],
    ) -> Result<(), DataError> {
        let size = value.len() as u64;
        let local = self.staging(Some(value), size)?;
        self.write_from(&local, 0, size, replicas)?;
        self.unstage(local);
        Ok(())
    }

    /// WRITE `size` bytes at `offset` of `local` to every replica.
    fn write_from(
        &self,
        local: &transfer::LocalSegment,
        offset: u64,
        size: u64,
        replicas: &[ReplicaInfo],
    ) -> Result<(), DataError> {
        for r in replicas {
            check_length(r, size)?;
        }
        let mut remote_replicas = Vec::with_capacity(replicas.len());
        for r in replicas {
            match self.local_segment(r) {
                Some(seg) => copy_local(local.segment(), offset, &seg, r.offset, size, r)?,
                None => remote_replicas.push(r),
            }
        }
        if remote_replicas.is_empty() {
            return Ok(());
        }
        let mut requests = Vec::with_capacity(remote_replicas.len());
        for r in remote_replicas.iter().copied() {
            requests.push(self.request(TransferOp::Write, local, offset, r, size)?);
        }
        self.engine
            .transfer(requests)
            .map_err(|source| DataError::Transfer {
                name: replica_names(remote_replicas.iter().copied()),
                source,
            })
    }
}
