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
//! how a connection starts.

mod dial;
mod inline;
mod lane;
mod peer;

use std::sync::Arc;

use parking_lot::Mutex;

pub(crate) use dial::{DialError, Dialer};
pub(crate) use inline::InlineSlice;
pub(crate) use peer::Peer;

use crate::batch::RequestState;
use crate::error::Failure;
use crate::frame::{Header, Opcode};
use crate::memory::Segment;
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

/// One unit of work on one lane: a piece of a request.
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
}

impl Slice {
    /// Settle the slice. The segment reference is released before the request is told, so a
    /// caller that sees its batch finish also sees every transfer's hold on its memory gone.
    fn settle(mut self, result: Result<(), Failure>) {
        self.local = None;
        if let Some(req) = self.req.take() {
            req.slice_done(result);
        }
    }
}

impl Drop for Slice {
    fn drop(&mut self) {
        self.local = None;
        if let Some(req) = self.req.take() {
            req.slice_done(Err(Failure::new(
                "lane_closed",
                "the connection carrying this request closed before it completed",
            )));
        }
    }
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
