//! The target side of vectored requests (READV, WRITEV; see `frame`): the range table read
//! and checked (every range in bounds and, for reads, passed by the segment's read check),
//! then the ranges' bytes moved with one vectored socket call. A bad table or range refuses
//! the whole request with an ERROR, writes nothing, and keeps the stream in step.
//! I/O boundary: the connection's stream.

use std::sync::Arc;

use super::{DataStream, ServerCtx, discard, segment_of};
use crate::frame::{self, ErrorCode, Header, Opcode};
use crate::memory::{Segment, Span};
use crate::wire::{self, WireError};

/// Answer a READV (`h`): one READ_DATA with the ranges' bytes, or an ERROR.
pub(super) fn serve_readv<S: DataStream>(
    s: &mut S,
    ctx: &ServerCtx,
    h: &Header,
) -> Result<(), WireError> {
    let id = h.request_id;
    let table = wire::read_control_payload(s, h)?;
    match vectored_target(ctx, h, &table, true) {
        Ok((seg, ranges, total)) => {
            let mut r = Header::new(Opcode::ReadData, id);
            r.length = total;
            ctx.metrics
                .served_bytes
                .with_label_values(&["read"])
                .inc_by(total);
            s.send_spans_with_header(&r.encode(), &spans_of(&seg, &ranges))
                .map_err(WireError::Io)
        }
        Err((code, reason)) => wire::write_error(s, id, code, &reason),
    }
}

/// Apply a WRITEV (`h`): the ranges' bytes received into the segment, then WRITE_ACK; or the
/// payload discarded and an ERROR.
pub(super) fn serve_writev<S: DataStream>(
    s: &mut S,
    ctx: &ServerCtx,
    h: &Header,
) -> Result<(), WireError> {
    let id = h.request_id;
    // The table's size follows from the range count; a count that cannot be right leaves
    // nothing to trust about where the data starts: skip the whole payload.
    let table_len = h.offset.saturating_mul(frame::RANGE_ENTRY_LEN as u64);
    if h.offset == 0 || h.offset > frame::MAX_RANGES as u64 || table_len > h.length {
        discard(s, h.length)?;
        return wire::write_error(
            s,
            id,
            ErrorCode::Malformed,
            &format!(
                "WRITEV of {} ranges in a {}-byte payload",
                h.offset, h.length
            ),
        );
    }
    let mut table = vec![0u8; table_len as usize];
    wire::read_full(s, &mut table, &mut wire::fail_on_timeout)?;
    let data_len = h.length - table_len;
    let target = vectored_target(ctx, h, &table, false).and_then(|t| {
        if t.2 == data_len {
            Ok(t)
        } else {
            Err((
                ErrorCode::Malformed,
                format!("WRITEV ranges of {} bytes with {data_len} data bytes", t.2),
            ))
        }
    });
    match target {
        Ok((seg, ranges, total)) => {
            s.recv_into_spans(&spans_of(&seg, &ranges))
                .map_err(WireError::Io)?;
            ctx.metrics
                .served_bytes
                .with_label_values(&["write"])
                .inc_by(total);
            s.write_all(&Header::new(Opcode::WriteAck, id).encode())
                .map_err(WireError::Io)
        }
        Err((code, reason)) => {
            discard(s, data_len)?;
            wire::write_error(s, id, code, &reason)
        }
    }
}

/// The segment and ranges of a READV or WRITEV (`table` already read), every range in bounds
/// and, for reads, passed by the segment's read check; with the ranges' total length.
#[allow(clippy::type_complexity)]
fn vectored_target(
    ctx: &ServerCtx,
    h: &Header,
    table: &[u8],
    read: bool,
) -> Result<(Arc<Segment>, Vec<(u64, u64)>, u64), (ErrorCode, String)> {
    let (ranges, total) = frame::decode_ranges(h.offset, table, ctx.max_slice).map_err(|e| {
        let code = match e {
            frame::RangeError::TooLarge { .. } => ErrorCode::TooLarge,
            _ => ErrorCode::Malformed,
        };
        (code, e.to_string())
    })?;
    let seg = segment_of(ctx, h)?;
    let check = if read {
        ctx.registry.read_checks.read().get(&h.handle).cloned()
    } else {
        None
    };
    for &(offset, len) in &ranges {
        seg.check_range(offset, len)
            .map_err(|e| (ErrorCode::OutOfBounds, e.to_string()))?;
        if let Some(check) = &check {
            check(offset, len).map_err(|reason| (ErrorCode::Internal, reason))?;
        }
    }
    Ok((seg, ranges, total))
}

fn spans_of<'a>(seg: &'a Segment, ranges: &[(u64, u64)]) -> Vec<Span<'a>> {
    ranges
        .iter()
        .map(|&(offset, len)| Span::new(seg, offset, len as usize))
        .collect()
}
