//! Initiator side of the TCP transport: a peer is a set of lanes (connections), each driven by
//! a sender thread and a receiver thread so that slices are pipelined; payloads move straight
//! between sockets and segment memory. I/O boundary: the outgoing TCP sockets.
//!
//! Every slice is settled exactly once: by its reply, by the failure of its lane, or — if it
//! is dropped anywhere on the way (a queue torn down, a thread gone) — by its `Drop`, which
//! fails it. So no request can stay pending forever.
//!
//! Here: the slice (the unit of work) and the lanes' settings; `peer` holds the lanes to one
//! address, `lane` one connection, its sender and receiver threads and what they share, `dial`
//! how a connection starts, `inline` transfers on the caller's thread, `replies` the inline
//! reply reading over any descriptor (for fuzzing).

mod dial;
mod inline;
mod lane;
mod peer;
mod replies;

use std::sync::Arc;

use parking_lot::Mutex;

pub(crate) use dial::{DialError, Dialer};
pub(crate) use inline::{InlinePart, InlineSlice};
pub(crate) use peer::Peer;
pub use replies::{ExpectedReply, ReplyOutcome, ReplyReader};

use crate::batch::RequestState;
use crate::error::Failure;
use crate::frame::{self, Header, Opcode};
use crate::memory::{Segment, Span};
use crate::metrics::TransferMetrics;

/// What a slice does.
pub(crate) enum SliceKind {
    Read,
    Write,
    /// A control request (OPEN, NOTIFY) with its payload; the reply header is stored in `reply`.
    Control {
        opcode: Opcode,
        payload: Vec<u8>,
        reply: Arc<Mutex<Option<Header>>>,
    },
}

/// One unit of work on one lane: a piece of a request, or (with `more`) several small
/// requests to the same segment carried by one vectored frame.
pub(crate) struct Slice {
    pub(crate) req: Option<Arc<RequestState>>,
    pub(crate) kind: SliceKind,
    pub(crate) local: Option<Arc<Segment>>,
    pub(crate) local_offset: u64,
    pub(crate) handle: u32,
    /// The target's instance (see OPEN_OK), sent in READ and WRITE headers; 0: none.
    pub(crate) instance: u32,
    pub(crate) remote_offset: u64,
    pub(crate) len: u64,
    /// Further ranges of the same segment, same direction, sent in the same frame (READV or
    /// WRITEV); empty for a plain READ or WRITE.
    pub(crate) more: Vec<Part>,
}

/// One more range of a vectored slice, with the request it belongs to.
pub(crate) struct Part {
    pub(crate) req: Arc<RequestState>,
    pub(crate) local: Arc<Segment>,
    pub(crate) local_offset: u64,
    pub(crate) remote_offset: u64,
    pub(crate) len: u64,
}

impl Slice {
    /// Settle the slice. The segment references are released before the requests are told, so
    /// a caller that sees its batch finish also sees every transfer's hold on its memory gone.
    fn settle(mut self, result: Result<(), Failure>) {
        for req in self.release() {
            req.slice_done(result.clone());
        }
    }

    /// Drop the slice's hold on segment memory and hand out the requests to settle.
    fn release(&mut self) -> Vec<Arc<RequestState>> {
        self.local = None;
        let mut reqs: Vec<Arc<RequestState>> = self.req.take().into_iter().collect();
        reqs.extend(self.more.drain(..).map(|p| p.req));
        reqs
    }

    /// Bytes the slice moves, over all its ranges.
    pub(crate) fn total_len(&self) -> u64 {
        self.len + self.more.iter().map(|p| p.len).sum::<u64>()
    }

    /// The remote ranges, in frame order.
    fn remote_ranges(&self) -> Vec<(u64, u64)> {
        std::iter::once((self.remote_offset, self.len))
            .chain(self.more.iter().map(|p| (p.remote_offset, p.len)))
            .collect()
    }

    /// The local memory of every range, in frame order (`None`: a slice without memory).
    fn local_spans(&self) -> Option<Vec<Span<'_>>> {
        let first = self.local.as_ref()?;
        let mut spans = vec![Span::new(first, self.local_offset, self.len as usize)];
        spans.extend(
            self.more
                .iter()
                .map(|p| Span::new(&p.local, p.local_offset, p.len as usize)),
        );
        Some(spans)
    }
}

impl Drop for Slice {
    fn drop(&mut self) {
        for req in self.release() {
            req.slice_done(Err(Failure::new(
                "lane_closed",
                "the connection carrying this request closed before it completed",
            )));
        }
    }
}

/// The header and the bytes that follow it (before any WRITE data) of a data frame over
/// `ranges` of segment `handle`: READ or WRITE for one range, READV or WRITEV (with the
/// range table) for several.
pub(crate) fn data_frame(
    write: bool,
    id: u64,
    handle: u32,
    instance: u32,
    ranges: &[(u64, u64)],
) -> Vec<u8> {
    let total: u64 = ranges.iter().map(|r| r.1).sum();
    let (mut header, table) = match ranges {
        [(offset, len)] => {
            let mut h = Header::new(if write { Opcode::Write } else { Opcode::Read }, id);
            h.offset = *offset;
            h.length = *len;
            (h, Vec::new())
        }
        _ => {
            let table = frame::encode_ranges(ranges.iter().copied());
            let mut h = Header::new(if write { Opcode::WriteV } else { Opcode::ReadV }, id);
            h.offset = ranges.len() as u64;
            h.length = table.len() as u64 + if write { total } else { 0 };
            (h, table)
        }
    };
    header.handle = handle;
    header.status = instance;
    let mut out = Vec::with_capacity(frame::HEADER_LEN + table.len());
    out.extend_from_slice(&header.encode());
    out.extend_from_slice(&table);
    out
}

/// Settings shared by all lanes of an engine.
#[derive(Clone)]
pub(crate) struct LaneConfig {
    /// How lanes connect; its timeout also bounds every slice.
    pub(crate) dialer: Dialer,
    pub(crate) window: usize,
    pub(crate) max_slice: u64,
    /// How long inline transfers poll for a reply before sleeping on the socket.
    pub(crate) spin_wait: std::time::Duration,
    pub(crate) metrics: TransferMetrics,
}

/// Whether a request of `len` bytes may share a vectored frame with others: only requests
/// well below a slice (larger ones are cut into slices of their own).
pub(crate) fn packable(len: u64, slice_size: u64) -> bool {
    len > 0 && len <= slice_size / 2
}
