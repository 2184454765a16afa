//! Posting work requests: a slice goes to its NIC (or the next healthy one), its local memory
//! registered on first use, bounds checked against both regions; a failed slice marks its NIC
//! down and is retried on another, handed to TCP, or failed, as the failover plan says.
//! I/O boundary: `post` through the verbs traits; the TCP fallback dispatches to the lanes.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{Inflight, Shared};
use crate::batch::TransferOp;
use crate::error::{Failure, error_chain};
use crate::rdma::datapath::{RdmaOp, WorkRequest};
use crate::rdma::plan::Next;
use crate::tcp::{Slice, SliceKind};

impl Shared {
    /// Post a slice on its NIC, or the next healthy one; failures go through [`Self::failed`].
    pub(super) fn dispatch(&self, mut inf: Inflight) {
        let routed = self.failover.lock().route(inf.slice.nic);
        let Some(nic) = routed else {
            let next = self.failover.lock().exhausted(inf.slice);
            self.follow(next, inf, "no healthy RDMA NIC left".into());
            return;
        };
        inf.slice.nic = nic;
        if let Err((inf, reason)) = self.post(inf) {
            self.failed(inf, reason);
        }
    }

    fn post(&self, mut inf: Inflight) -> Result<(), (Inflight, String)> {
        let Some(path) = self.paths.get(inf.slice.nic) else {
            let reason = format!("no NIC path {}", inf.slice.nic);
            return Err((inf, reason));
        };
        let mr = {
            let key = inf.local.addr();
            let mut cache = path.local.lock();
            match cache.get(&key) {
                Some(mr) => mr.clone(),
                None => match path.device.register(&inf.local) {
                    Ok(mr) => {
                        cache.insert(key, mr.clone());
                        mr
                    }
                    Err(e) => {
                        let reason = format!("{}: {}", path.device.name(), error_chain(&e));
                        return Err((inf, reason));
                    }
                },
            }
        };
        // Bounds were checked against both segment sizes by `submit`; the region lengths are
        // checked again here so that a wrong registration cannot address outside it.
        let local_off = inf.local_base + inf.slice.offset;
        let remote_off = inf.remote_base + inf.slice.offset;
        let len = inf.slice.len;
        if local_off.checked_add(len).is_none_or(|e| e > mr.size())
            || remote_off
                .checked_add(len)
                .is_none_or(|e| e > path.remote.len)
        {
            let reason = format!("slice at {local_off}/{remote_off}+{len} is outside a region");
            return Err((inf, reason));
        }
        let Ok(len32) = u32::try_from(len) else {
            return Err((inf, format!("slice of {len} bytes exceeds 4 GiB")));
        };
        let wr_id = self.next_wr.fetch_add(1, Ordering::Relaxed);
        let wr = WorkRequest {
            wr_id,
            op: match inf.op {
                TransferOp::Read => RdmaOp::Read,
                TransferOp::Write => RdmaOp::Write,
            },
            local_addr: mr.addr() + local_off,
            lkey: mr.lkey(),
            len: len32,
            remote_addr: path.remote.addr + remote_off,
            rkey: path.remote.rkey,
        };
        inf.posted_at = Instant::now();
        // In the table before posting: the completion may arrive at once.
        let mut table = self.inflight.lock();
        table.insert(wr_id, inf);
        let posted = path.qp.post(&wr);
        match posted {
            Ok(()) => {
                drop(table);
                self.wake.notify_one();
                Ok(())
            }
            Err(e) => {
                let reason = format!("{}: {}", path.device.name(), error_chain(&e));
                match table.remove(&wr_id) {
                    Some(inf) => Err((inf, reason)),
                    None => Ok(()),
                }
            }
        }
    }

    /// A slice failed on its NIC: mark the NIC down and retry elsewhere, move to TCP, or fail.
    pub(super) fn failed(&self, inf: Inflight, reason: String) {
        tracing::debug!(peer = %self.peer, nic = inf.slice.nic, %reason, "RDMA slice failed");
        let next = self.failover.lock().on_failure(inf.slice);
        self.follow(next, inf, reason);
    }

    fn follow(&self, next: Next, mut inf: Inflight, reason: String) {
        match next {
            Next::Retry(s) => {
                self.retries.fetch_add(1, Ordering::Relaxed);
                self.retry_metric.inc();
                inf.slice = s;
                self.dispatch(inf);
            }
            Next::FallbackTcp(s) => match &self.tcp {
                Some(tcp) => {
                    (tcp.on_fallback)(&reason);
                    tcp.peer.dispatch(Slice {
                        req: Some(inf.req),
                        kind: match inf.op {
                            TransferOp::Read => SliceKind::Read,
                            TransferOp::Write => SliceKind::Write,
                        },
                        local: Some(inf.local),
                        local_offset: inf.local_base + s.offset,
                        handle: tcp.handle,
                        instance: 0,
                        remote_offset: inf.remote_base + s.offset,
                        len: s.len,
                        more: Vec::new(),
                    });
                }
                None => inf.req.slice_done(Err(self.failure(&reason))),
            },
            Next::Fail => inf.req.slice_done(Err(self.failure(&reason))),
        }
    }

    fn failure(&self, reason: &str) -> Failure {
        Failure::new("rdma", format!("RDMA to {}: {reason}", self.peer))
    }
}
