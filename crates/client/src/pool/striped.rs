//! Striped objects (see [`StripeConfig`](super::StripeConfig)): a put writes every part (one
//! `put_start` batch, one transfer batch, one `put_end` batch) before the manifest that makes
//! the object visible; a get locates every part in one batch and reads them into one buffer;
//! removal takes the parts with the manifest. Failures remove what was placed, so no orphan
//! part stays. I/O boundary: the master's gRPC channel and the transfer engine's connections.

use super::PoolClient;
use super::error::DataError;
use super::get::Dest;
use super::manifest::{MANIFEST_LEN, Manifest};
use super::naming::{replica_name, replica_names};
use super::put::Source;
use super::transport::check_part_length;
use crate::master::pick_nearest;
use futures::future::BoxFuture;
use kvpool_core::master::types::{PutOptions, PutStarted, ReplicaInfo};
use kvpool_transfer::{self as transfer, TransferOp, TransferRequest};

/// A part the master allocated: its index, put id and replicas.
type AllocatedPart = (u32, u64, Vec<ReplicaInfo>);

impl PoolClient {
    /// Parts first (one `put_start` batch, one transfer batch, one `put_end` batch), then the
    /// manifest: the object becomes visible only once every part is committed. Any failure
    /// revokes or removes the parts already placed.
    pub(super) async fn put_striped(
        &self,
        key: &[u8],
        source: Source<'_>,
        m: Manifest,
        opts: &PutOptions,
    ) -> Result<Vec<ReplicaInfo>, DataError> {
        if self
            .master
            .exists(&[key])
            .await
            .map_err(DataError::Master)?
            == [true]
        {
            return Ok(Vec::new());
        }
        let part_keys = m.part_keys(key);
        let items: Vec<(&[u8], u64)> = part_keys
            .iter()
            .zip(0..)
            .map(|(k, i)| (k.as_slice(), m.part(i).1))
            .collect();
        let started = self
            .master
            .put_start_batch(&items, opts)
            .await
            .map_err(DataError::Master)?;
        let mut allocated: Vec<AllocatedPart> = Vec::new();
        let mut refused = None;
        for (i, r) in (0..).zip(started) {
            match r {
                Ok(PutStarted::Allocated { put_id, replicas }) => {
                    allocated.push((i, put_id, replicas));
                }
                // A part of an earlier identical put: same key, same bytes.
                Ok(PutStarted::AlreadyCommitted { .. }) => {}
                Err(e) => {
                    refused.get_or_insert(e);
                }
            }
        }
        let pending: Vec<(&[u8], u64)> = allocated
            .iter()
            .filter_map(|(i, id, _)| Some((part_keys.get(*i as usize)?.as_slice(), *id)))
            .collect();
        let written = match refused {
            Some(e) => {
                // Nothing was written: the parts placed are given back at once.
                self.revoke_unsent(&pending).await;
                return Err(DataError::Master(e));
            }
            None => {
                let parts = allocated.clone();
                self.write_staged(source, move |this, local, base| {
                    this.write_parts(local, base, &m, &parts)
                })
                .await
            }
        };
        if let Err(e) = written {
            for (k, id) in &pending {
                if let Err(revoke) = self.master.put_revoke(k, *id).await {
                    tracing::warn!(error = %revoke, "revoking a striped part failed");
                }
            }
            return Err(e);
        }
        let ended = self.master.put_end_batch(&pending).await;
        let failed = match ended {
            Ok(items) => items.into_iter().find_map(Result::err),
            Err(e) => Some(e),
        };
        if let Some(e) = failed {
            self.drop_parts(&part_keys).await;
            return Err(DataError::Master(e));
        }
        let manifest = m.encode(key);
        if let Err(e) = self.put_plain(key, Source::Bytes(&manifest), opts).await {
            self.drop_parts(&part_keys).await;
            return Err(e);
        }
        Ok(allocated.into_iter().flat_map(|(_, _, r)| r).collect())
    }

    /// Best-effort removal of parts (missing ones are fine: that is the goal).
    async fn drop_parts(&self, keys: &[Vec<u8>]) {
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        if let Err(e) = self.master.remove_batch(&refs).await {
            tracing::warn!(error = %e, "removing the parts of a striped object failed");
        }
    }

    /// WRITE every allocated part (all replicas) from `local` at `base` in one batch.
    fn write_parts(
        &self,
        local: &transfer::LocalSegment,
        base: u64,
        m: &Manifest,
        parts: &[AllocatedPart],
    ) -> Result<(), DataError> {
        let mut requests = Vec::new();
        for (i, _, replicas) in parts {
            for r in replicas {
                requests.push(self.part_request(TransferOp::Write, local, base, m, *i, r)?);
            }
        }
        self.engine
            .transfer(requests)
            .map_err(|source| DataError::Transfer {
                name: replica_names(parts.iter().flat_map(|(_, _, replicas)| replicas)),
                source,
            })
    }

    /// A transfer (`op`) of part `i` between `local` (the whole value at `base`) and its
    /// replica `r`.
    fn part_request(
        &self,
        op: TransferOp,
        local: &transfer::LocalSegment,
        base: u64,
        m: &Manifest,
        i: u32,
        r: &ReplicaInfo,
    ) -> Result<TransferRequest, DataError> {
        let (off, len) = m.part(i);
        check_part_length(r, i, len)?;
        self.request(op, local, base + off, r, len)
    }

    /// Locate every part (one batch, leases on all), read them into `dest`. A missing part
    /// means the object was partly evicted: what is left of it is removed so that no orphan
    /// part stays, and the read fails with `StripeIncomplete`.
    /// Boxed out of line: compiled once here, not in each crate that awaits a get.
    #[inline(never)]
    pub(super) fn get_striped<'a>(
        &'a self,
        key: &'a [u8],
        m: Manifest,
        dest: &'a Dest,
    ) -> BoxFuture<'a, Result<transfer::LocalSegment, DataError>> {
        Box::pin(async move {
            let part_keys = m.part_keys(key);
            let refs: Vec<&[u8]> = part_keys.iter().map(Vec::as_slice).collect();
            let located = self
                .master
                .get_batch(&refs)
                .await
                .map_err(DataError::Master)?;
            let mut leases = Vec::with_capacity(located.len());
            let mut parts = Vec::with_capacity(located.len());
            let mut problem = None;
            for (i, r) in (0..).zip(located) {
                match r {
                    Ok(l) => {
                        leases.push((l.lease_id, l.lease_deadline, l.lease_ttl));
                        if l.size == m.part(i).1 {
                            parts.push(l.replicas);
                        } else {
                            problem.get_or_insert(DataError::StripeMismatch {
                                part: i,
                                got: l.size,
                                want: m.part(i).1,
                            });
                        }
                    }
                    Err(source) => {
                        problem.get_or_insert(DataError::StripeIncomplete {
                            part: i,
                            parts: m.parts,
                            source,
                        });
                    }
                }
            }
            let result = match problem {
                Some(e) => Err(e),
                None => {
                    let this = self.clone();
                    let d = dest.clone();
                    self.blocking(move || this.read_parts(&m, &parts, &d)).await
                }
            };
            let now = std::time::Instant::now();
            let expired = leases.iter().find(|(_, deadline, _)| now >= *deadline);
            let result = match (result, expired) {
                (Ok(local), Some((_, _, ttl))) => {
                    self.done_with(dest, local);
                    Err(DataError::LeaseExpired { ttl: *ttl })
                }
                (r, _) => r,
            };
            for (id, _, _) in leases {
                self.master.release_lease_later(id);
            }
            if matches!(result, Err(DataError::StripeIncomplete { .. })) {
                let mut all = part_keys;
                all.push(key.to_vec());
                self.drop_parts(&all).await;
            }
            result
        })
    }

    /// Read every part into `dest`: nearest replicas in one batch, then, if that fails, part
    /// by part through every replica.
    fn read_parts(
        &self,
        m: &Manifest,
        parts: &[Vec<ReplicaInfo>],
        dest: &Dest,
    ) -> Result<transfer::LocalSegment, DataError> {
        let (local, base) = self.destination(dest, m.total)?;
        let nearest: Result<Vec<_>, DataError> = (0..)
            .zip(parts)
            .map(|(i, replicas)| {
                let r = pick_nearest(replicas, &self.node, self.numa_node)
                    .ok_or(DataError::NoReplica)?;
                self.part_request(TransferOp::Read, &local, base, m, i, r)
            })
            .collect();
        let failed = match nearest.map(|reqs| self.engine.transfer(reqs)) {
            Ok(Ok(())) => return Ok(local),
            Ok(Err(e)) => Some(e),
            Err(_) => None,
        };
        // Slow path. Staging: a fresh buffer (the failed batch may still hold the old one).
        // A caller's buffer is reused unless the batch was abandoned unsettled.
        let local = match dest {
            Dest::Staging => {
                drop(local);
                self.staging(None, m.total)?
            }
            Dest::Buffer(..) => {
                if let Some(source) = failed.filter(|f| f.index.is_none()) {
                    return Err(DataError::Transfer {
                        name: "striped parts".into(),
                        source,
                    });
                }
                local
            }
        };
        for (i, replicas) in (0..).zip(parts) {
            let mut last = DataError::NoReplica;
            let mut done = false;
            for r in replicas {
                let name = replica_name(r);
                match self
                    .part_request(TransferOp::Read, &local, base, m, i, r)
                    .and_then(|q| {
                        self.engine
                            .transfer(vec![q])
                            .map_err(|source| DataError::Transfer { name, source })
                    }) {
                    Ok(()) => {
                        done = true;
                        break;
                    }
                    Err(e) => last = e,
                }
            }
            if !done {
                return Err(last);
            }
        }
        Ok(local)
    }

    /// Remove an object; for a striped one, its parts too.
    /// Boxed out of line: compiled once here, not in each crate that awaits a remove.
    #[inline(never)]
    pub fn remove<'a>(&'a self, key: &'a [u8]) -> BoxFuture<'a, Result<(), DataError>> {
        Box::pin(async move {
            let located = self.master.get(key).await.map_err(DataError::Master)?;
            let manifest = if located.size == MANIFEST_LEN as u64 {
                let this = self.clone();
                let replicas = located.replicas.clone();
                let read = self
                    .blocking(move || this.read_vec_any(MANIFEST_LEN as u64, &replicas))
                    .await;
                match read {
                    Ok(v) => Manifest::decode(key, &v),
                    Err(e) => {
                        self.master.release_lease_later(located.lease_id);
                        return Err(e);
                    }
                }
            } else {
                None
            };
            // Our own lease would make the master refuse the remove; `remove` flushes the
            // queued releases before it asks.
            self.master.release_lease_later(located.lease_id);
            if let Some(m) = manifest {
                // The manifest first: from then on no reader finds the parts.
                self.master.remove(key).await.map_err(DataError::Master)?;
                self.drop_parts(&m.part_keys(key)).await;
                return Ok(());
            }
            self.master.remove(key).await.map_err(DataError::Master)
        })
    }
}
