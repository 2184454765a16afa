//! Batches of zero-copy puts and gets (Mooncake's `batch_put_from` / `batch_get_into`): one
//! master call locates (or allocates) every key, one transfer batch moves every value (the
//! engine spreads it over the peers' lanes; a get whose nearest replica lives in this process,
//! an agent's own tier, is a memory copy in the same blocking step), and one master call
//! commits the puts. Whatever the one-batch path cannot take (a value that is or may be a
//! striped object, a put with a replica in this process, a transfer or copy that failed) goes
//! through the single-item path, which keeps its own fallbacks (other replicas, placing a put
//! again without an unreachable node). Same semantics as that path item by item: read leases
//! checked after the read and released in the background, a failed write revoked. I/O
//! boundary: the master's gRPC channel (or a fork's fast lane), the transfer engine's
//! connections and copies within this process's memory.

use std::sync::Arc;

use futures::future::join_all;
use kvpool_core::master::types::{PutOptions, PutStarted, ReplicaInfo};
use kvpool_proto::master::MAX_BATCH;
use kvpool_transfer::{self as transfer, BatchFailed, Segment, TransferOp, TransferRequest};

use super::PoolClient;
use super::error::DataError;
use super::local::copy_local;
use super::manifest::MANIFEST_LEN;
use super::naming::replica_names;
use super::transport::{check_length, request_on};
use crate::master::{Located, pick_nearest};

/// One item of a batch: a key and the registered ranges its value spans, in order (buffer,
/// offset in it, bytes). A put stores the ranges' concatenation. A get of one range reads a
/// value of at most that many bytes into it; of several, the value must fill them exactly
/// (a larger value fails with [`DataError::BufferTooSmall`], a smaller one with
/// [`DataError::SizeMismatch`], before any byte moves). A get with `part` set reads only the
/// ranges' bytes from that offset of the value on (the value must hold them: else
/// [`DataError::OutsideValue`]); puts store whole values and refuse it.
#[derive(Clone, Debug)]
pub struct BatchItem<'a> {
    pub key: &'a [u8],
    pub ranges: Vec<(&'a transfer::LocalSegment, u64, u64)>,
    /// Read part of the value, from this offset of it (gets only).
    pub part: Option<u64>,
}

impl<'a> BatchItem<'a> {
    /// An item of one range.
    pub fn one(key: &'a [u8], buffer: &'a transfer::LocalSegment, offset: u64, len: u64) -> Self {
        BatchItem {
            key,
            ranges: vec![(buffer, offset, len)],
            part: None,
        }
    }

    fn total(&self) -> u64 {
        self.ranges.iter().map(|r| r.2).sum()
    }

    /// Room for a value read into the ranges (one range: its bytes inside the buffer).
    fn room(&self) -> u64 {
        match self.ranges.as_slice() {
            [(buf, offset, len)] if self.part.is_none() => {
                (*len).min(buf.len().saturating_sub(*offset))
            }
            _ => self.total(),
        }
    }

    /// The bytes a get of a value of `size` bytes reads (the whole value, or the part).
    pub(super) fn read_len(&self, size: u64) -> u64 {
        match self.part {
            Some(_) => self.total(),
            None => size,
        }
    }

    /// Where the bytes read start in the value.
    fn value_offset(&self) -> u64 {
        self.part.unwrap_or(0)
    }

    /// Whether a value of `size` bytes may be read into the ranges.
    pub(super) fn fits(&self, size: u64) -> Result<(), DataError> {
        if let Some(offset) = self.part {
            let len = self.total();
            return match offset.checked_add(len) {
                Some(end) if end <= size => Ok(()),
                _ => Err(DataError::OutsideValue { offset, len, size }),
            };
        }
        let room = self.room();
        if size > room {
            return Err(DataError::BufferTooSmall { size, have: room });
        }
        if self.ranges.len() > 1 && size < room {
            return Err(DataError::SizeMismatch {
                got: size,
                want: room,
            });
        }
        Ok(())
    }

    /// The ranges a value of `size` bytes fills, in order: (buffer, offset, bytes); one range
    /// takes the whole value (unless only a part is read).
    fn filled(&self, size: u64) -> impl Iterator<Item = (&'a transfer::LocalSegment, u64, u64)> {
        let one = self.ranges.len() == 1 && self.part.is_none();
        self.ranges
            .iter()
            .filter(|r| r.2 > 0)
            .map(move |&(buf, offset, len)| (buf, offset, if one { size } else { len }))
    }

    /// One request per range, between the ranges and replica `r` (which holds the value of
    /// `size` bytes from its offset on).
    pub(super) fn requests(
        &self,
        client: &PoolClient,
        op: TransferOp,
        r: &ReplicaInfo,
        size: u64,
    ) -> Result<Vec<TransferRequest>, DataError> {
        check_length(r, size)?;
        // One open for every range: they all read or write the same replica.
        let remote = client.open(r)?;
        let mut at = r.offset + self.value_offset();
        let mut out = Vec::with_capacity(self.ranges.len());
        for (buf, offset, len) in self.filled(size) {
            out.push(request_on(op, buf, offset, remote.clone(), at, len));
            at += len;
        }
        Ok(out)
    }
}

/// The read of a value whose nearest replica lives in this process (an agent's own tier):
/// plain memory copies, run with the batch's transfers.
struct LocalRead {
    src: Arc<Segment>,
    /// Where the bytes to read start in `src`.
    start: u64,
    replica: ReplicaInfo,
    /// (buffer, offset, bytes) per range, in the value's order.
    ranges: Vec<(transfer::LocalSegment, u64, u64)>,
}

impl LocalRead {
    fn copy(&self) -> Result<(), DataError> {
        let mut at = self.start;
        for (buf, offset, len) in &self.ranges {
            copy_local(&self.src, at, buf.segment(), *offset, *len, &self.replica)?;
            at += len;
        }
        Ok(())
    }
}

/// How an item of a get batch is read.
enum Planned {
    /// Transfers from a peer (the requests and the replica's name).
    Remote(Vec<TransferRequest>, String),
    /// Copies from a replica in this process.
    Local(LocalRead),
}

/// What became of an item after the one-batch step.
enum Step<T> {
    Done(Result<T, DataError>),
    /// Through the single-item path.
    Alone,
}

fn transfer_error(name: &str, failed: &BatchFailed) -> DataError {
    DataError::Transfer {
        name: name.to_owned(),
        source: failed.clone(),
    }
}

impl PoolClient {
    /// Read the value of each key into its ranges (one range: see [`Self::get_to_within`]):
    /// per item the value's length or why it failed.
    pub async fn get_many_to(&self, items: &[BatchItem<'_>]) -> Vec<Result<u64, DataError>> {
        let mut out = Vec::with_capacity(items.len());
        for chunk in items.chunks(MAX_BATCH) {
            out.extend(self.get_chunk(chunk).await);
        }
        out
    }

    async fn get_chunk(&self, items: &[BatchItem<'_>]) -> Vec<Result<u64, DataError>> {
        let keys: Vec<&[u8]> = items.iter().map(|i| i.key).collect();
        let located = match self.master.get_batch(&keys).await {
            Ok(l) => l,
            // The master call itself failed: each item on its own (with its own retries).
            Err(_) => {
                let steps = items.iter().map(|_| Step::Alone).collect();
                return self.get_alone(items, steps).await;
            }
        };
        let mut steps = Vec::with_capacity(items.len());
        let mut leases: Vec<Option<Located>> = Vec::with_capacity(items.len());
        let mut requests = Vec::new();
        // Per item read in the batch: its index and the replica's name.
        let mut moved: Vec<(usize, String)> = Vec::new();
        // Items read from this process's own segments: their index and copies.
        let mut locals: Vec<(usize, LocalRead)> = Vec::new();
        for (item, l) in items.iter().zip(located) {
            let l = match l {
                Ok(l) => l,
                Err(e) => {
                    steps.push(Step::Done(Err(DataError::Master(e))));
                    leases.push(None);
                    continue;
                }
            };
            let step = match self.read_requests(item, &l) {
                Ok(Some(Planned::Remote(reqs, name))) => {
                    moved.push((steps.len(), name));
                    requests.extend(reqs);
                    Step::Done(Ok(item.read_len(l.size)))
                }
                Ok(Some(Planned::Local(read))) => {
                    locals.push((steps.len(), read));
                    Step::Done(Ok(item.read_len(l.size)))
                }
                Ok(None) => Step::Alone,
                Err(e) => Step::Done(Err(e)),
            };
            steps.push(step);
            leases.push(Some(l));
        }
        if !requests.is_empty() || !locals.is_empty() {
            let copies: Vec<usize> = locals.iter().map(|(i, _)| *i).collect();
            let this = self.clone();
            let read = self
                .blocking(move || {
                    // Copies first (the memory of this process), then the peers' transfers.
                    let copied: Vec<(usize, Result<(), DataError>)> =
                        locals.into_iter().map(|(i, l)| (i, l.copy())).collect();
                    let sent = if requests.is_empty() {
                        Ok(())
                    } else {
                        this.engine.transfer(requests)
                    };
                    Ok((copied, sent))
                })
                .await
                .map(|(copied, sent)| {
                    for (i, r) in copied {
                        // A failed copy goes alone: the single-item path tries the other
                        // replicas.
                        if let Err(e) = r {
                            tracing::debug!(error = %e, "a local copy of a batch failed");
                            steps[i] = Step::Alone;
                        }
                    }
                    sent
                });
            match read {
                Ok(Ok(())) => {}
                // Every request settled: the single-item path reads them again (and tries
                // the other replicas).
                Ok(Err(failed)) if failed.index.is_some() => {
                    for (i, _) in &moved {
                        steps[*i] = Step::Alone;
                    }
                }
                // Abandoned unsettled: bytes may still land in the callers' buffers, which
                // must not be reused for another read.
                Ok(Err(failed)) => {
                    for (i, name) in &moved {
                        steps[*i] = Step::Done(Err(transfer_error(name, &failed)));
                    }
                }
                Err(e) => {
                    let text = e.to_string();
                    for i in moved.iter().map(|(i, _)| i).chain(&copies) {
                        steps[*i] = Step::Done(Err(DataError::Join(text.clone())));
                    }
                }
            }
        }
        for (step, lease) in steps.iter_mut().zip(&leases) {
            let Some(l) = lease else { continue };
            self.master.release_lease_later(l.lease_id);
            if matches!(step, Step::Done(Ok(_))) && !l.lease_held() {
                *step = Step::Done(Err(DataError::LeaseExpired { ttl: l.lease_ttl }));
            }
        }
        self.get_alone(items, steps).await
    }

    /// How a located value is read into the item's ranges: the READs from its nearest
    /// replica and that replica's name, or the copies from a replica in this process; `None`
    /// when the value goes through the single-item path (it may be a striped object's
    /// manifest, or its nearest replica cannot be read as it is: the single-item path then
    /// tries the others).
    fn read_requests(
        &self,
        item: &BatchItem<'_>,
        l: &Located,
    ) -> Result<Option<Planned>, DataError> {
        item.fits(l.size)?;
        let Some(r) = pick_nearest(&l.replicas, &self.node, self.numa_node) else {
            return Ok(None);
        };
        if l.size == MANIFEST_LEN as u64 {
            return Ok(None);
        }
        if let Some(src) = self.local_segment(r) {
            if check_length(r, l.size).is_err() {
                return Ok(None);
            }
            let ranges = item
                .filled(l.size)
                .map(|(buf, offset, len)| (buf.clone(), offset, len))
                .collect();
            return Ok(Some(Planned::Local(LocalRead {
                src,
                start: r.offset + item.value_offset(),
                replica: r.clone(),
                ranges,
            })));
        }
        let Ok(reqs) = item.requests(self, TransferOp::Read, r, l.size) else {
            return Ok(None);
        };
        let name = reqs
            .first()
            .map(|q| q.remote.name().to_owned())
            .unwrap_or_default();
        Ok(Some(Planned::Remote(reqs, name)))
    }

    /// Finish the items left [`Step::Alone`] one by one, concurrently.
    async fn get_alone(
        &self,
        items: &[BatchItem<'_>],
        steps: Vec<Step<u64>>,
    ) -> Vec<Result<u64, DataError>> {
        join_all(items.iter().zip(steps).map(|(item, s)| async move {
            match s {
                Step::Done(r) => r,
                Step::Alone => self.get_one(item).await,
            }
        }))
        .await
    }

    /// One item through the single-item path: one range straight into it, several (or a
    /// part of the value) through one copy of the value.
    async fn get_one(&self, item: &BatchItem<'_>) -> Result<u64, DataError> {
        if let ([(buf, offset, len)], None) = (item.ranges.as_slice(), item.part) {
            return self.get_to_within(item.key, buf, *offset, *len).await;
        }
        let value = self.get(item.key).await?;
        let size = value.len() as u64;
        item.fits(size)?;
        let start = usize::try_from(item.value_offset()).unwrap_or(usize::MAX);
        let mut rest = value.get(start..).unwrap_or_default();
        for &(buf, offset, len) in &item.ranges {
            let (head, tail) = rest.split_at(len as usize);
            buf.segment()
                .write_at(offset, head)
                .map_err(|source| DataError::Staging { size, source })?;
            rest = tail;
        }
        Ok(item.read_len(size))
    }

    /// Store each item's bytes (one range: see [`Self::put_from`]); per item `Ok` or why it
    /// failed.
    pub async fn put_many_from(
        &self,
        items: &[BatchItem<'_>],
        opts: &PutOptions,
    ) -> Vec<Result<(), DataError>> {
        let mut out = Vec::with_capacity(items.len());
        for chunk in items.chunks(MAX_BATCH) {
            out.extend(self.put_chunk(chunk, opts).await);
        }
        out
    }

    async fn put_chunk(
        &self,
        items: &[BatchItem<'_>],
        opts: &PutOptions,
    ) -> Vec<Result<(), DataError>> {
        let mut steps: Vec<Step<()>> = Vec::with_capacity(items.len());
        let mut batched = Vec::new();
        for item in items {
            let checked = item.ranges.iter().try_for_each(|&(buf, offset, len)| {
                buf.segment()
                    .check_range(offset, len)
                    .map_err(|source| DataError::Staging { size: len, source })
            });
            let step = match checked {
                Err(e) => Step::Done(Err(e)),
                Ok(()) if item.part.is_some() => Step::Done(Err(DataError::PartialPut)),
                Ok(()) if self.striped_as(item.total()).is_some() => Step::Alone,
                Ok(()) => {
                    batched.push(steps.len());
                    Step::Alone
                }
            };
            steps.push(step);
        }
        if !batched.is_empty() {
            self.put_batched(items, &batched, &mut steps, opts).await;
        }
        join_all(items.iter().zip(steps).map(|(item, s)| async move {
            match s {
                Step::Done(r) => r,
                Step::Alone => self.put_one(item, opts).await,
            }
        }))
        .await
    }

    /// One item through the single-item path: one range straight from it, several through
    /// one copy of the value.
    async fn put_one(&self, item: &BatchItem<'_>, opts: &PutOptions) -> Result<(), DataError> {
        if let [(buf, offset, len)] = item.ranges.as_slice() {
            return self
                .put_from(item.key, buf, *offset, *len, opts)
                .await
                .map(drop);
        }
        let total = item.total();
        let mut value = vec![0u8; usize::try_from(total).unwrap_or(usize::MAX)];
        let mut at = 0usize;
        for &(buf, offset, len) in &item.ranges {
            let n = len as usize;
            buf.segment()
                .read_at(offset, &mut value[at..at + n])
                .map_err(|source| DataError::Staging {
                    size: total,
                    source,
                })?;
            at += n;
        }
        self.put(item.key, &value, opts).await.map(drop)
    }

    /// The one-batch step of a put: allocate every item of `which` in one master call, write
    /// them in one transfer batch, commit them in one master call. Items it cannot finish are
    /// left [`Step::Alone`] (revoked first when allocated).
    async fn put_batched(
        &self,
        items: &[BatchItem<'_>],
        which: &[usize],
        steps: &mut [Step<()>],
        opts: &PutOptions,
    ) {
        let starts: Vec<(&[u8], u64)> = which
            .iter()
            .map(|&i| (items[i].key, items[i].total()))
            .collect();
        let Ok(started) = self.master.put_start_batch(&starts, opts).await else {
            return; // each item on its own, with its own retries
        };
        let mut requests = Vec::new();
        let mut targets: Vec<ReplicaInfo> = Vec::new();
        // Puts whose bytes go in the batch: item index and put id.
        let mut sent: Vec<(usize, u64)> = Vec::new();
        for (&i, s) in which.iter().zip(started) {
            let (put_id, replicas) = match s {
                Ok(PutStarted::AlreadyCommitted { .. }) => {
                    steps[i] = Step::Done(Ok(()));
                    continue;
                }
                Ok(PutStarted::Allocated { put_id, replicas }) => (put_id, replicas),
                Err(e) => {
                    steps[i] = Step::Done(Err(DataError::Master(e)));
                    continue;
                }
            };
            let item = &items[i];
            let reqs: Result<Vec<_>, _> = replicas
                .iter()
                .map(|r| match self.local_segment(r) {
                    // A replica in this process: the single-item path copies it in place.
                    Some(_) => Err(DataError::NoReplica),
                    None => item.requests(self, TransferOp::Write, r, item.total()),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(|v| v.into_iter().flatten().collect());
            match reqs {
                Ok(reqs) => {
                    requests.extend(reqs);
                    targets.extend(replicas);
                    sent.push((i, put_id));
                }
                // Nothing sent: revoked at once, and left to the single-item path.
                Err(_) => self.revoke_unsent(&[(item.key, put_id)]).await,
            }
        }
        if requests.is_empty() {
            return;
        }
        let this = self.clone();
        let written = self
            .blocking(move || Ok(this.engine.transfer(requests)))
            .await;
        if !matches!(written, Ok(Ok(()))) {
            if let Ok(Err(failed)) = &written {
                tracing::debug!(name = %replica_names(targets.iter()), error = %failed,
                    "a batch of puts failed; each goes alone");
            }
            // Bytes may have been (partly) sent: revoke, and put each on its own (which
            // places it again without a node that could not be reached).
            for &(i, put_id) in &sent {
                if let Err(e) = self.master.put_revoke(items[i].key, put_id).await {
                    tracing::warn!(error = %e, "revoking a failed batched put failed");
                }
            }
            return;
        }
        let ends: Vec<(&[u8], u64)> = sent.iter().map(|&(i, id)| (items[i].key, id)).collect();
        match self.master.put_end_batch(&ends).await {
            Ok(results) => {
                for (&(i, _), r) in sent.iter().zip(results) {
                    steps[i] = Step::Done(r.map_err(DataError::Master));
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "committing a batch of puts failed; one by one");
                for &(i, put_id) in &sent {
                    let r = self.master.put_end(items[i].key, put_id).await;
                    steps[i] = Step::Done(r.map_err(DataError::Master));
                }
            }
        }
    }
}
