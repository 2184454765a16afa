//! The sender thread of a lane: takes slices off the lane's queue, waits for a free slot in
//! the pipelining window, records the slice as in flight and writes its frame (a WRITE's
//! payload straight from segment memory). I/O boundary: the lane's socket, writing.

use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use super::io::LaneWriter;
use super::{InFlight, LaneShared, TICK};
use crate::error::Failure;
use crate::frame::{self, Header};
use crate::memory::{Segment, Span};
use crate::tcp::{self, Slice, SliceKind};
use crate::wire;

/// How long a failed send waits for the receiver to learn the peer's reason.
const REASON_GRACE: Duration = Duration::from_secs(1);

pub(super) fn sender_loop(sh: Arc<LaneShared>, mut stream: LaneWriter, rx: Receiver<Slice>) {
    loop {
        let slice = match rx.recv_timeout(TICK) {
            Ok(s) => s,
            Err(RecvTimeoutError::Timeout) if sh.is_dead() => break,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => break,
        };
        // A queue slot freed: wake a submitter blocked in `Lane::send`.
        sh.cv.notify_all();
        if sh.is_dead() {
            slice.settle(Err(sh.failure()));
            continue;
        }
        {
            let mut q = sh.outstanding.lock();
            while q.len() >= sh.cfg.window && !sh.is_dead() {
                sh.cv.wait_for(&mut q, TICK);
            }
        }
        if sh.is_dead() {
            slice.settle(Err(sh.failure()));
            continue;
        }
        let id = sh.next_id.fetch_add(1, Ordering::Relaxed);
        // The frame's head (header, range table or control payload), and for writes where
        // the data comes from.
        let (head, write_data) = match &slice.kind {
            SliceKind::Read | SliceKind::Write => {
                let write = matches!(slice.kind, SliceKind::Write);
                let head = tcp::data_frame(
                    write,
                    id,
                    slice.handle,
                    slice.instance,
                    &slice.remote_ranges(),
                );
                (head, write)
            }
            SliceKind::Control {
                opcode, payload: p, ..
            } => {
                let mut header = Header::new(*opcode, id);
                header.length = p.len() as u64;
                let mut head = Vec::with_capacity(frame::HEADER_LEN + p.len());
                head.extend_from_slice(&header.encode());
                head.extend_from_slice(p);
                (head, false)
            }
        };
        // The write's memory stays referenced by the slice, which is in flight (and so
        // alive) until its reply or the lane's failure; the sender holds its own references.
        let payload: Vec<(Arc<Segment>, u64, usize)> = if write_data {
            let mut v = Vec::with_capacity(1 + slice.more.len());
            if let Some(seg) = &slice.local {
                v.push((seg.clone(), slice.local_offset, slice.len as usize));
            }
            v.extend(
                slice
                    .more
                    .iter()
                    .map(|p| (p.local.clone(), p.local_offset, p.len as usize)),
            );
            v
        } else {
            Vec::new()
        };
        let single = slice.more.is_empty();
        let ranges = 1 + slice.more.len();
        {
            // Check `dead` under the queue lock: `fail` sets it before draining under the same
            // lock, so a slice is either drained by `fail` or never queued on a dead lane.
            let mut q = sh.outstanding.lock();
            if sh.is_dead() {
                drop(q);
                slice.settle(Err(sh.failure()));
                continue;
            }
            q.push_back(InFlight {
                slice,
                id,
                sent_at: Instant::now(),
            });
        }
        if !single {
            sh.cfg.metrics.vectored_frames.inc();
            sh.cfg.metrics.vectored_requests.inc_by(ranges as u64);
        }
        let result = send_frame(&mut stream, &head, &payload);
        if let Err(e) = result {
            // A target that refuses a frame (an integrity failure, say) sends an ERROR naming
            // why and closes; a middlebox may turn that close into a reset that breaks this
            // send first. The ERROR is still in the receive queue: let the receiver read it,
            // so the transfer fails with the target's reason rather than the broken pipe.
            if !wire::is_timeout(&e) {
                sh.wait_dead(REASON_GRACE);
            }
            sh.fail(Failure::new(
                wire::io_category(&e),
                format!("sending to {} failed: {e}", sh.peer),
            ));
        }
    }
    // Anything still queued is failed by Slice::drop when `rx` drops here.
}

fn send_frame(
    stream: &mut LaneWriter,
    head: &[u8],
    payload: &[(Arc<Segment>, u64, usize)],
) -> io::Result<()> {
    let spans: Vec<Span<'_>> = payload
        .iter()
        .map(|(seg, off, len)| Span::new(seg, *off, *len))
        .collect();
    stream.send(head, &spans)
}
