//! The sender thread of a lane: takes slices off the lane's queue, waits for a free slot in
//! the pipelining window, records the slice as in flight and writes its frame (a WRITE's
//! payload straight from segment memory). I/O boundary: the lane's socket, writing.

use std::io;
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Instant;

use super::{InFlight, LaneShared, TICK};
use crate::error::Failure;
use crate::frame::{self, Header, Opcode};
use crate::memory::{Segment, Span};
use crate::tcp::{Slice, SliceKind};
use crate::wire::{self, is_timeout};

pub(super) fn sender_loop(sh: Arc<LaneShared>, mut stream: TcpStream, rx: Receiver<Slice>) {
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
        let mut header;
        let mut payload: Option<(Arc<Segment>, u64, usize)> = None;
        let mut control: Vec<u8> = Vec::new();
        match &slice.kind {
            SliceKind::Read => {
                header = Header::new(Opcode::Read, id);
                header.length = slice.len;
            }
            SliceKind::Write => {
                header = Header::new(Opcode::Write, id);
                header.length = slice.len;
                if let Some(seg) = &slice.local {
                    payload = Some((seg.clone(), slice.local_offset, slice.len as usize));
                }
            }
            SliceKind::Control {
                opcode, payload: p, ..
            } => {
                header = Header::new(*opcode, id);
                header.length = p.len() as u64;
                control = p.clone();
            }
        }
        header.handle = slice.handle;
        header.offset = slice.remote_offset;
        if !matches!(slice.kind, SliceKind::Control { .. }) {
            header.status = slice.instance;
        }
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
        let result = send_frame(&mut stream, &header, &control, payload);
        if let Err(e) = result {
            sh.fail(Failure::new(
                if is_timeout(&e) { "timeout" } else { "io" },
                format!("sending to {} failed: {e}", sh.peer),
            ));
        }
    }
    // Anything still queued is failed by Slice::drop when `rx` drops here.
}

fn send_frame(
    stream: &mut TcpStream,
    header: &Header,
    control: &[u8],
    payload: Option<(Arc<Segment>, u64, usize)>,
) -> io::Result<()> {
    use std::io::Write;
    if let Some((seg, off, len)) = payload {
        return Span::new(&seg, off, len).send_prefixed(
            stream.as_fd(),
            &header.encode(),
            &mut wire::fail_on_timeout,
        );
    }
    let mut buf = Vec::with_capacity(frame::HEADER_LEN + control.len());
    buf.extend_from_slice(&header.encode());
    buf.extend_from_slice(control);
    stream.write_all(&buf)
}
