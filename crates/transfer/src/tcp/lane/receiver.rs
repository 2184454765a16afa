//! The receiver thread of a lane: reads reply headers, matches each to the oldest slice in
//! flight (replies come in order), receives READ payloads straight into segment memory and
//! settles the slice; a slice without a reply within the timeout fails the lane.
//! I/O boundary: the lane's socket, reading.

use std::io;
use std::sync::Arc;

use super::LaneShared;
use super::io::LaneReader;
use crate::error::Failure;
use crate::frame::{ErrorCode, Opcode};
use crate::seal::is_integrity;
use crate::tcp::SliceKind;
use crate::wire::{self, WireError, is_timeout};

pub(super) fn receiver_loop(sh: Arc<LaneShared>, mut stream: LaneReader) {
    let timeout = sh.cfg.dialer.timeout;
    let mut deadline_check = || -> io::Result<()> {
        if sh.is_dead() {
            return Err(io::Error::other("lane closed"));
        }
        let q = sh.outstanding.lock();
        match q.front() {
            Some(f) if f.sent_at.elapsed() > timeout => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no reply from {} within {timeout:?}", sh.peer),
            )),
            _ => Ok(()),
        }
    };
    loop {
        let header = match wire::read_header(&mut stream, sh.cfg.max_slice, &mut deadline_check) {
            Ok(h) => h,
            Err(e) => {
                let failure = match &e {
                    WireError::Closed => {
                        Failure::new("peer_closed", format!("{} closed the connection", sh.peer))
                    }
                    WireError::Io(io) if is_timeout(io) => Failure::new("timeout", io.to_string()),
                    WireError::Io(io) if is_integrity(io) => detected(
                        &sh,
                        io,
                        Failure::new("integrity", format!("from {}: {io}", sh.peer)),
                    ),
                    other => Failure::from(other),
                };
                sh.fail(failure);
                return;
            }
        };
        let Some(inflight) = sh.outstanding.lock().pop_front() else {
            sh.fail(Failure::new(
                "protocol",
                format!("unsolicited {:?} from {}", header.opcode, sh.peer),
            ));
            return;
        };
        sh.cv.notify_all();
        // Replies come in order; only a connection-level ERROR (request id 0) may name no request.
        let connection_error = header.opcode == Opcode::Error && header.request_id == 0;
        if inflight.id != header.request_id && !connection_error {
            sh.fail(Failure::new(
                "protocol",
                format!(
                    "reply for request {} while {} was expected",
                    header.request_id, inflight.id
                ),
            ));
            inflight.slice.settle(Err(sh.failure()));
            return;
        }
        let slice = inflight.slice;
        let outcome: Result<Result<(), Failure>, Failure> = match (header.opcode, &slice.kind) {
            (Opcode::WriteAck, SliceKind::Write) => Ok(Ok(())),
            (Opcode::ReadData, SliceKind::Read) => {
                let total = slice.total_len();
                if header.length != total {
                    Err(Failure::new(
                        "protocol",
                        format!("READ of {total} bytes answered with {}", header.length),
                    ))
                } else if let Some(spans) = slice.local_spans() {
                    let sent_at = inflight.sent_at;
                    let mut payload_deadline = || -> io::Result<()> {
                        if sent_at.elapsed() > timeout {
                            Err(io::Error::new(
                                io::ErrorKind::TimedOut,
                                "read payload stalled",
                            ))
                        } else {
                            Ok(())
                        }
                    };
                    match stream.recv_spans(&spans, &mut payload_deadline) {
                        Ok(()) => Ok(Ok(())),
                        Err(e) => Err(detected(
                            &sh,
                            &e,
                            Failure::new(
                                wire::io_category(&e),
                                format!("receiving from {} failed: {e}", sh.peer),
                            ),
                        )),
                    }
                } else {
                    Err(Failure::new("protocol", "read slice without local memory"))
                }
            }
            (
                op @ (Opcode::OpenOk | Opcode::NotifyAck),
                SliceKind::Control { opcode, reply, .. },
            ) if (op == Opcode::OpenOk) == (*opcode == Opcode::Open) => {
                *reply.lock() = Some(header);
                Ok(Ok(()))
            }
            (Opcode::Error, _) => match wire::read_control_payload(&mut stream, &header) {
                Ok(reason) => {
                    let code = ErrorCode::from_u32(header.status);
                    let reason = String::from_utf8_lossy(&reason).into_owned();
                    if header.request_id == 0 {
                        // Connection-level error (malformed frame, failed integrity check):
                        // the peer closes.
                        let category = match code {
                            ErrorCode::Integrity => "integrity",
                            _ => "remote",
                        };
                        Err(Failure::new(
                            category,
                            format!("{} closed the connection: {reason}", sh.peer),
                        ))
                    } else {
                        Ok(Err(Failure::new(code.as_str(), reason)))
                    }
                }
                Err(e) => Err(Failure::from(&e)),
            },
            (op, _) => Err(Failure::new(
                "protocol",
                format!("unexpected {op:?} from {}", sh.peer),
            )),
        };
        match outcome {
            Ok(result) => slice.settle(result),
            Err(lane_failure) => {
                slice.settle(Err(lane_failure.clone()));
                sh.fail(lane_failure);
                return;
            }
        }
    }
}

/// `failure`, after counting it in `kvpool_transfer_integrity_failures_total{side="initiator"}`
/// when `e` is a failed integrity check detected here.
fn detected(sh: &LaneShared, e: &io::Error, failure: Failure) -> Failure {
    if is_integrity(e) {
        sh.cfg
            .metrics
            .integrity_failures
            .with_label_values(&["initiator"])
            .inc();
    }
    failure
}
