//! Moving bytes on opened segments: batch submission (bounds checks, then each request cut
//! into slices for its route: a memory copy for shared memory, work requests striped over NICs
//! for RDMA, slices over the lanes for TCP), waiting for a batch, and the control round trips
//! (OPEN, NOTIFY) on a peer's first lane. I/O boundary: none here; the routes do the I/O.

use std::sync::Arc;

use parking_lot::Mutex;

use super::TransferEngine;
use super::handles::{RemoteSegment, Route, TransferRequest};
use crate::batch::{Batch, BatchBuilder, BatchFailed, RequestState, TransferOp};
use crate::error::{Failure, TransferError, error_chain};
use crate::frame::{self, ErrorCode, Opcode};
use crate::memory::{self, MemoryError};
use crate::tcp::{self, InlinePart, InlineSlice, Part, Peer, Slice, SliceKind};

/// The shared-memory copies of one submission at least this large are shared between the
/// submitting thread and one more: one thread's copy runs well below what the memory moves
/// (measured here: 16 MiB into a peer's mapping in 3.7 ms on one thread, 2.1 ms on two; with
/// TCP the peer's CPU does half the work, with shared memory nobody else does).
const SHM_PARALLEL_MIN: u64 = 4 << 20;

/// A shared-memory request this large is copied as two halves.
const SHM_SPLIT_MIN: u64 = 2 << 20;

/// One memory copy of a shared-memory request (the whole of it, or a half).
struct ShmCopy {
    req: Arc<RequestState>,
    src: Arc<memory::Segment>,
    src_offset: u64,
    dst: Arc<memory::Segment>,
    dst_offset: u64,
    len: u64,
}

impl ShmCopy {
    /// `vouched`: the kernel vouched for the caller memory of the whole batch.
    fn run(self, vouched: bool) {
        let result = memory::copy_between_in(
            &self.src,
            self.src_offset,
            &self.dst,
            self.dst_offset,
            self.len as usize,
            vouched,
        )
        .map_err(|e| Failure::new(e.category(), e.to_string()));
        self.req.slice_done(result);
    }
}

/// Run `copies` on this thread, or, from [`SHM_PARALLEL_MIN`] bytes on, about half of their
/// bytes on a second thread (in order: each thread copies a run of consecutive pieces).
fn run_shm(mut copies: Vec<ShmCopy>) {
    // One question to the kernel for the batch's caller memory instead of one per copy.
    let vouched = copies.len() > 1
        && memory::vouch_copies(
            copies
                .iter()
                .map(|c| (&*c.src, c.src_offset, &*c.dst, c.dst_offset, c.len as usize)),
        );
    let run = |c: ShmCopy| c.run(vouched);
    let total: u64 = copies.iter().map(|c| c.len).sum();
    if total < SHM_PARALLEL_MIN || copies.len() < 2 {
        copies.into_iter().for_each(run);
        return;
    }
    let mut acc = 0;
    let split = copies
        .iter()
        .position(|c| {
            acc += c.len;
            acc >= total / 2
        })
        .map_or(copies.len() - 1, |i| i + 1)
        .clamp(1, copies.len() - 1);
    // Taken by the helper thread, or by this one when no thread can be had.
    let second = Mutex::new(Some(copies.split_off(split)));
    let run_second = || {
        if let Some(rest) = second.lock().take() {
            rest.into_iter().for_each(run);
        }
    };
    std::thread::scope(|scope| {
        let helper = std::thread::Builder::new()
            .name("kvpool-xfer-copy".into())
            .spawn_scoped(scope, run_second);
        copies.into_iter().for_each(run);
        match helper {
            Ok(h) => {
                let _ = h.join();
            }
            Err(_) => run_second(),
        }
    });
}

impl TransferEngine {
    /// Send a control request on lane 0 and wait for its reply header.
    pub(super) fn control(
        &self,
        peer: &Peer,
        opcode: Opcode,
        payload: Vec<u8>,
    ) -> Result<frame::Header, Failure> {
        let mut b = BatchBuilder::new(1, self.inner.metrics.clone());
        let req = b.request("tcp", "control", 0, 1);
        let batch = b.finish();
        let reply = Arc::new(Mutex::new(None));
        peer.dispatch_on(
            0,
            Slice {
                req: Some(req),
                kind: SliceKind::Control {
                    opcode,
                    payload,
                    reply: reply.clone(),
                },
                local: None,
                local_offset: 0,
                handle: 0,
                instance: 0,
                remote_offset: 0,
                len: 0,
                more: Vec::new(),
            },
        );
        batch
            .wait_ok(self.inner.config.timeout + self.inner.config.connect_timeout)
            .map_err(|e| e.failure)?;
        let h = *reply.lock();
        h.ok_or_else(|| Failure::new("protocol", "reply missing"))
    }

    /// Submit a batch. Requests are validated (bounds on both sides) before anything is sent;
    /// an invalid request fails the whole submission. Returns once everything is queued.
    pub fn submit(&self, requests: Vec<TransferRequest>) -> Result<Batch, TransferError> {
        check_bounds(&requests)?;
        let slice_size = self.inner.config.slice_size;
        let mut builder = BatchBuilder::new(requests.len(), self.inner.metrics.clone());
        // The vectored slice being filled with small TCP requests, and its peer.
        let mut open: Option<(Arc<Peer>, Slice)> = None;
        // Shared-memory copies, run once the network requests are on their way.
        let mut shm: Vec<ShmCopy> = Vec::new();
        for r in requests {
            match &r.remote.route {
                Route::Shm(remote) => {
                    let (src, so, dst, dof) = match r.op {
                        TransferOp::Read => (
                            remote.clone(),
                            r.remote_offset,
                            r.local.segment().clone(),
                            r.local_offset,
                        ),
                        TransferOp::Write => (
                            r.local.segment().clone(),
                            r.local_offset,
                            remote.clone(),
                            r.remote_offset,
                        ),
                    };
                    // A large request is copied as two halves, which may go to two threads.
                    let halves = if r.len >= SHM_SPLIT_MIN { 2 } else { 1 };
                    let req = builder.request("shm", r.op.as_str(), r.len, halves as usize);
                    let mut at = 0;
                    for i in 0..halves {
                        let len = if i + 1 == halves {
                            r.len - at
                        } else {
                            r.len / 2
                        };
                        shm.push(ShmCopy {
                            req: req.clone(),
                            src: src.clone(),
                            src_offset: so + at,
                            dst: dst.clone(),
                            dst_offset: dof + at,
                            len,
                        });
                        at += len;
                    }
                }
                Route::Rdma { channel, .. } => {
                    let plan = channel.plan(r.len, r.local.segment().numa_node());
                    let req = builder.request("rdma", r.op.as_str(), r.len, plan.len());
                    channel.submit(
                        &req,
                        plan,
                        r.op,
                        r.local.segment(),
                        r.local_offset,
                        r.remote_offset,
                    );
                }
                Route::Tcp(peer) if self.packs(&r) => {
                    let req = builder.request("tcp", r.op.as_str(), r.len, 1);
                    let joins = open.as_ref().is_some_and(|(p, s)| {
                        Arc::ptr_eq(p, peer)
                            && s.handle == r.remote.handle
                            && s.instance == r.remote.instance
                            && matches!(
                                (&s.kind, r.op),
                                (SliceKind::Read, TransferOp::Read)
                                    | (SliceKind::Write, TransferOp::Write)
                            )
                            && s.more.len() + 1 < frame::MAX_RANGES
                            && s.total_len() + r.len <= slice_size
                    });
                    if let (true, Some((_, s))) = (joins, open.as_mut()) {
                        s.more.push(Part {
                            req,
                            local: r.local.segment().clone(),
                            local_offset: r.local_offset,
                            remote_offset: r.remote_offset,
                            len: r.len,
                        });
                        continue;
                    }
                    if let Some((p, s)) = open.take() {
                        p.dispatch(s);
                    }
                    let slice = Slice {
                        req: Some(req),
                        kind: match r.op {
                            TransferOp::Read => SliceKind::Read,
                            TransferOp::Write => SliceKind::Write,
                        },
                        local: Some(r.local.segment().clone()),
                        local_offset: r.local_offset,
                        handle: r.remote.handle,
                        instance: r.remote.instance,
                        remote_offset: r.remote_offset,
                        len: r.len,
                        more: Vec::new(),
                    };
                    open = Some((peer.clone(), slice));
                }
                Route::Tcp(peer) => {
                    let n = r.len.div_ceil(slice_size).max(1);
                    let req = builder.request("tcp", r.op.as_str(), r.len, n as usize);
                    for i in 0..n {
                        let off = i * slice_size;
                        let len = slice_size.min(r.len - off);
                        peer.dispatch(Slice {
                            req: Some(req.clone()),
                            kind: match r.op {
                                TransferOp::Read => SliceKind::Read,
                                TransferOp::Write => SliceKind::Write,
                            },
                            local: Some(r.local.segment().clone()),
                            local_offset: r.local_offset + off,
                            handle: r.remote.handle,
                            instance: r.remote.instance,
                            remote_offset: r.remote_offset + off,
                            len,
                            more: Vec::new(),
                        });
                    }
                }
            }
        }
        if let Some((p, s)) = open.take() {
            p.dispatch(s);
        }
        run_shm(shm);
        Ok(builder.finish())
    }

    /// Whether `r` may share a vectored frame with other small requests of its batch.
    fn packs(&self, r: &TransferRequest) -> bool {
        self.inner.config.vectored
            && r.remote.vectored
            && tcp::packable(r.len, self.inner.config.slice_size)
    }

    /// Submit and wait for a batch, failing on the first failed request. A small batch over
    /// TCP to one peer (see [`EngineConfig::inline_max_bytes`]) is run by this thread itself.
    /// A batch refused because a segment's handle is stale (a segment from
    /// [`Self::open_cached`] whose target restarted or registered it again) is run once more
    /// after opening those segments again.
    ///
    /// [`EngineConfig::inline_max_bytes`]: crate::EngineConfig::inline_max_bytes
    pub fn transfer(&self, mut requests: Vec<TransferRequest>) -> Result<(), BatchFailed> {
        let failed = match self.transfer_once(&requests) {
            Err(e) if e.failure.category == ErrorCode::UnknownSegment.as_str() => e,
            done => return done,
        };
        if requests.iter().all(|r| r.remote.instance == 0) {
            return Err(failed); // no kept handle: nothing to open again
        }
        for r in &mut requests {
            if r.remote.instance == 0 {
                continue;
            }
            self.forget(&r.remote);
            match self.reopen(&r.remote) {
                Some(fresh) => r.remote = fresh,
                None => return Err(failed),
            }
        }
        self.transfer_once(&requests)
    }

    /// A TCP segment opened again by name on the same peer; `None` when that fails.
    fn reopen(&self, remote: &RemoteSegment) -> Option<RemoteSegment> {
        let Route::Tcp(peer) = &remote.route else {
            return None;
        };
        let reply = self
            .control(peer, Opcode::Open, remote.name.as_bytes().to_vec())
            .ok()?;
        if reply.length != remote.size {
            return None; // another segment under the name: the caller's offsets mean nothing
        }
        Some(RemoteSegment {
            handle: reply.handle,
            instance: reply.status,
            vectored: reply.offset & frame::FEATURE_VECTORED != 0,
            ..remote.clone()
        })
    }

    /// One attempt: inline when small enough, else through the lanes (which take their own
    /// copy of the requests; the caller keeps them for a second attempt).
    fn transfer_once(&self, requests: &[TransferRequest]) -> Result<(), BatchFailed> {
        let invalid = |e: TransferError| BatchFailed {
            index: None,
            failure: Failure::new(e.category(), error_chain(&e)),
        };
        if let Some(peer) = self.inline_peer(requests) {
            check_bounds(requests).map_err(invalid)?;
            return self.transfer_inline(&peer, requests);
        }
        let batch = self.submit(requests.to_vec()).map_err(invalid)?;
        // Each slice is bounded by the per-connection timeout; this outer bound only guards
        // against a bug: it is generous on purpose.
        batch.wait_ok(self.inner.config.timeout * 4 + self.inner.config.connect_timeout)
    }

    /// Send a small message (at most 64 KiB) to the owner of `remote`; returns once the peer
    /// queued it.
    pub fn notify(&self, remote: &RemoteSegment, payload: &[u8]) -> Result<(), TransferError> {
        let (Route::Tcp(peer) | Route::Rdma { tcp: peer, .. }) = &remote.route else {
            return Err(TransferError::Notify {
                peer: remote.name.to_string(),
                reason: "notify needs a TCP route; open the segment with Protocol::Tcp".into(),
            });
        };
        if payload.len() as u64 > frame::MAX_CONTROL_PAYLOAD {
            return Err(TransferError::Notify {
                peer: peer.addr().to_string(),
                reason: format!("message of {} bytes exceeds 64 KiB", payload.len()),
            });
        }
        self.control(peer, Opcode::Notify, payload.to_vec())
            .map(|_| ())
            .map_err(|f| TransferError::Notify {
                peer: peer.addr().to_string(),
                reason: f.to_string(),
            })
    }
}

/// Every request within both its segments, else the first that is not.
fn check_bounds(requests: &[TransferRequest]) -> Result<(), TransferError> {
    for (index, r) in requests.iter().enumerate() {
        let invalid = |source| TransferError::InvalidRequest { index, source };
        r.local
            .segment()
            .check_range(r.local_offset, r.len)
            .map_err(invalid)?;
        if r.remote_offset
            .checked_add(r.len)
            .is_none_or(|e| e > r.remote.size)
        {
            return Err(invalid(MemoryError::OutOfBounds {
                offset: r.remote_offset,
                len: r.len,
                size: r.remote.size as usize,
            }));
        }
    }
    Ok(())
}

impl TransferEngine {
    /// The one TCP peer of a batch small enough to run inline, if it is one.
    fn inline_peer(&self, requests: &[TransferRequest]) -> Option<Arc<Peer>> {
        // Inline connections carry no sealed records and no TLS: with per-frame integrity or
        // TLS every transfer goes through the lanes.
        if self.inner.config.integrity == crate::Integrity::Require
            || self.inner.config.tls.mode == crate::TlsMode::Require
        {
            return None;
        }
        let max = self.inner.config.inline_max_bytes;
        let mut total = 0u64;
        let mut peer: Option<&Arc<Peer>> = None;
        for r in requests {
            let Route::Tcp(p) = &r.remote.route else {
                return None;
            };
            if peer.is_some_and(|q| !Arc::ptr_eq(q, p)) {
                return None;
            }
            peer = Some(p);
            total = total.saturating_add(r.len);
            if total > max {
                return None;
            }
        }
        peer.cloned()
    }

    /// Run a batch (bounds already checked) on a direct connection of `peer` from this
    /// thread: requests cut into slices as the lanes cut them, metrics as a submitted batch.
    fn transfer_inline(
        &self,
        peer: &Peer,
        requests: &[TransferRequest],
    ) -> Result<(), BatchFailed> {
        let slice_size = self.inner.config.slice_size;
        let mut builder = BatchBuilder::new(requests.len(), self.inner.metrics.clone());
        let mut slices: Vec<InlineSlice<'_>> = Vec::new();
        // The requests each slice settles.
        let mut owner: Vec<Vec<Arc<crate::batch::RequestState>>> = Vec::new();
        // Whether the last slice holds small requests (and so may take more of them).
        let mut last_packs = false;
        for r in requests {
            if self.packs(r) {
                let state = builder.request("tcp", r.op.as_str(), r.len, 1);
                let write = r.op == TransferOp::Write;
                if let Some(last) = slices.last_mut()
                    && last_packs
                    && last.write == write
                    && last.handle == r.remote.handle
                    && last.instance == r.remote.instance
                    && last.more.len() + 1 < frame::MAX_RANGES
                    && last.total_len() + r.len <= slice_size
                    && let Some(o) = owner.last_mut()
                {
                    last.more.push(InlinePart {
                        local: r.local.segment(),
                        local_offset: r.local_offset,
                        remote_offset: r.remote_offset,
                        len: r.len,
                    });
                    o.push(state);
                    continue;
                }
                slices.push(InlineSlice {
                    write,
                    local: r.local.segment(),
                    local_offset: r.local_offset,
                    handle: r.remote.handle,
                    instance: r.remote.instance,
                    remote_offset: r.remote_offset,
                    len: r.len,
                    more: Vec::new(),
                });
                owner.push(vec![state]);
                last_packs = true;
                continue;
            }
            last_packs = false;
            let n = r.len.div_ceil(slice_size).max(1);
            let state = builder.request("tcp", r.op.as_str(), r.len, n as usize);
            for i in 0..n {
                let off = i * slice_size;
                slices.push(InlineSlice {
                    write: r.op == TransferOp::Write,
                    local: r.local.segment(),
                    local_offset: r.local_offset + off,
                    handle: r.remote.handle,
                    instance: r.remote.instance,
                    remote_offset: r.remote_offset + off,
                    len: slice_size.min(r.len - off),
                    more: Vec::new(),
                });
                owner.push(vec![state.clone()]);
            }
        }
        let batch = builder.finish();
        peer.run_inline(&slices, &mut |i, result| {
            for state in owner.get(i).into_iter().flatten() {
                state.slice_done(result.clone());
            }
        });
        // Every slice was settled above: this returns at once.
        batch.wait_ok(self.inner.config.timeout)
    }
}
