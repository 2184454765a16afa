//! Wire format of the transfer engine's TCP and Unix-socket protocol: a fixed 40-byte,
//! versioned frame header, optionally followed by a payload. Pure: no I/O.
//!
//! ```text
//! offset size field
//!  0     4    magic       "KVTP" (0x4B56_5450, little endian)
//!  4     1    version     1
//!  5     1    opcode      see [`Opcode`]
//!  6     2    flags       0 (reserved; non-zero is rejected)
//!  8     8    request_id  chosen by the initiator, echoed in the reply
//! 16     4    handle      segment handle (from OPEN_OK)
//! 20     4    status      error code in ERROR replies; in OPEN_OK the target's instance,
//!                         which READ and WRITE may carry back (checked when non-zero); else 0
//! 24     8    offset      byte offset in the remote segment
//! 32     8    length      payload length; for READ the requested length, for OPEN_OK the
//!                         segment size (neither carries a payload)
//! ```
//! All integers are little endian. In OPEN_OK, `offset` carries the target's feature bits
//! ([`FEATURE_VECTORED`]); targets built before it send 0, and initiators built before it
//! ignore the field.
//!
//! Vectored requests move several ranges of one segment in one frame, so a batch of small
//! blocks costs about what one block of their total size costs (one header, one reply, one
//! wake-up each way). Their `offset` is the number of ranges `n` (1 to [`MAX_RANGES`]) and
//! their payload starts with the range table, `n` times (offset u64, length u64):
//! - READV: the payload is the table alone; the reply is one READ_DATA carrying the ranges'
//!   bytes back to back, in table order.
//! - WRITEV: the table, then the ranges' bytes back to back; the reply is WRITE_ACK.
//!
//! An initiator sends them only to a target whose OPEN_OK announced [`FEATURE_VECTORED`].

/// "KVTP" read as a little-endian u32.
pub const MAGIC: u32 = 0x4B56_5450;
/// Protocol version spoken by this build.
pub const VERSION: u8 = 1;
/// Size of the fixed header.
pub const HEADER_LEN: usize = 40;
/// Largest payload of a control frame (hello, auth, open, notify, error).
pub const MAX_CONTROL_PAYLOAD: u64 = 64 * 1024;
/// Default largest data payload (one slice) a peer accepts.
pub const DEFAULT_MAX_SLICE: u64 = 16 * 1024 * 1024;
/// OPEN_OK feature bit: the target serves READV and WRITEV.
pub const FEATURE_VECTORED: u64 = 1;
/// Feature bits this build announces in OPEN_OK.
pub const FEATURES: u64 = FEATURE_VECTORED;
/// Most ranges in one READV or WRITEV.
pub const MAX_RANGES: usize = 256;
/// Bytes of one entry of a vectored request's range table.
pub const RANGE_ENTRY_LEN: usize = 16;

/// Frame types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, strum::FromRepr)]
#[repr(u8)]
pub enum Opcode {
    /// Initiator -> target: client nonce (payload 32 bytes).
    Hello = 1,
    /// Target -> initiator: server nonce + server proof (payload 64 bytes).
    Challenge = 2,
    /// Initiator -> target: client proof (payload 32 bytes).
    Auth = 3,
    /// Target -> initiator: handshake accepted.
    AuthOk = 4,
    /// Open a segment by name (payload = UTF-8 name).
    Open = 5,
    /// Reply to OPEN: `handle` and `length` = segment size. Over the Unix socket the segment's
    /// memfd travels with this frame (SCM_RIGHTS).
    OpenOk = 6,
    /// Write `length` payload bytes at `offset` of segment `handle`.
    Write = 7,
    /// The write with `request_id` has been applied.
    WriteAck = 8,
    /// Read `length` bytes at `offset` of segment `handle` (no payload).
    Read = 9,
    /// Reply to READ: `length` payload bytes follow.
    ReadData = 10,
    /// A small application message (payload), delivered to the target's notification queue.
    Notify = 11,
    /// NOTIFY was queued.
    NotifyAck = 12,
    /// The request failed: `status` is an [`ErrorCode`], payload a UTF-8 reason.
    Error = 13,
    /// Connect RDMA queue pairs to a segment (payload: `rdma::handshake::ConnectRequest`, which
    /// carries its own version). Targets built before this opcode answer ERROR(malformed) and
    /// close; targets without an RDMA device answer ERROR(unsupported).
    RdmaConnect = 14,
    /// Reply to RDMA_CONNECT (payload: `rdma::handshake::ConnectReply`). The target keeps its
    /// queue pairs while this control connection stays open.
    RdmaConnectOk = 15,
    /// Read several ranges of segment `handle` (see the module docs): `offset` is the range
    /// count, the payload the range table; answered by one READ_DATA.
    ReadV = 16,
    /// Write several ranges of segment `handle`: `offset` is the range count, the payload the
    /// range table followed by the ranges' bytes; answered by WRITE_ACK.
    WriteV = 17,
}

impl Opcode {
    pub fn from_u8(v: u8) -> Option<Self> {
        Self::from_repr(v)
    }

    /// Whether this opcode answers a request on a target without an RDMA device: READ_DATA,
    /// WRITE_ACK, OPEN_OK, NOTIFY_ACK or ERROR (RDMA_CONNECT_OK needs a device).
    pub fn is_plain_reply(self) -> bool {
        matches!(
            self,
            Opcode::ReadData
                | Opcode::Error
                | Opcode::WriteAck
                | Opcode::OpenOk
                | Opcode::NotifyAck
        )
    }

    /// Whether the payload of this opcode is bulk data (bounded by the slice limit) rather than
    /// a control message (bounded by [`MAX_CONTROL_PAYLOAD`]).
    fn carries_data(self) -> bool {
        matches!(self, Opcode::Write | Opcode::ReadData)
    }
}

/// Why a vectored request's range table was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    #[error("{0} ranges in a vectored request (1 to {MAX_RANGES} allowed)")]
    Count(u64),
    #[error("a range table of {got} bytes for {count} ranges")]
    TableLength { count: u64, got: usize },
    #[error("the ranges add up to more than {limit} bytes")]
    TooLarge { limit: u64 },
}

/// The range table of a vectored request: `(offset, length)` pairs, in order.
pub fn encode_ranges(ranges: impl IntoIterator<Item = (u64, u64)>) -> Vec<u8> {
    let mut out = Vec::new();
    for (offset, len) in ranges {
        out.extend_from_slice(&offset.to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
    }
    out
}

/// Decode the table of `count` ranges; their lengths must add up to at most `max_total`.
/// Returns the ranges and their total length.
pub fn decode_ranges(
    count: u64,
    table: &[u8],
    max_total: u64,
) -> Result<(Vec<(u64, u64)>, u64), RangeError> {
    if count == 0 || count > MAX_RANGES as u64 {
        return Err(RangeError::Count(count));
    }
    if table.len() as u64 != count * RANGE_ENTRY_LEN as u64 {
        return Err(RangeError::TableLength {
            count,
            got: table.len(),
        });
    }
    let mut total = 0u64;
    let mut ranges = Vec::with_capacity(count as usize);
    for entry in table.chunks_exact(RANGE_ENTRY_LEN) {
        let (o, l) = entry.split_at(8);
        let offset = u64::from_le_bytes(o.try_into().unwrap_or_default());
        let len = u64::from_le_bytes(l.try_into().unwrap_or_default());
        total = total
            .checked_add(len)
            .filter(|t| *t <= max_total)
            .ok_or(RangeError::TooLarge { limit: max_total })?;
        ranges.push((offset, len));
    }
    Ok((ranges, total))
}

/// Error codes carried in the `status` field of ERROR frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::FromRepr, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
#[repr(u32)]
/// The values run from 1 in declaration order (pinned by a test): append new codes at the end.
pub enum ErrorCode {
    /// The frame could not be decoded (the connection is closed after this reply).
    Malformed = 1,
    /// The handshake failed: wrong key or a bad proof.
    Unauthenticated,
    /// No segment with that name or handle is registered.
    UnknownSegment,
    /// The offset and length are outside the segment.
    OutOfBounds,
    /// A payload exceeds the peer's limit.
    TooLarge,
    /// The request (or the transport it needs) is not served here.
    Unsupported,
    /// Anything else, including a refused read check; unknown codes read as this one.
    Internal,
    /// A frame failed its per-frame integrity check (connection-level, request id 0; the
    /// connection is closed after this reply).
    Integrity,
    /// Transport security refused: a plaintext connection to a target that requires TLS
    /// (connection-level, request id 0; the connection is closed after this reply).
    Tls,
}

impl ErrorCode {
    /// The code of a `status` field; unknown codes read as [`ErrorCode::Internal`].
    pub fn from_u32(v: u32) -> Self {
        Self::from_repr(v).unwrap_or(ErrorCode::Internal)
    }

    /// The code's name (`unknown_segment`), as failure categories and messages show it.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// Why a header was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum FrameError {
    #[error("frame truncated: {got} of {HEADER_LEN} header bytes")]
    Truncated { got: usize },
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    #[error("unsupported protocol version {0} (this build speaks {VERSION})")]
    BadVersion(u8),
    #[error("unknown opcode {0}")]
    UnknownOpcode(u8),
    #[error("reserved flags {0:#06x} set")]
    BadFlags(u16),
    #[error("{opcode:?} payload of {length} bytes exceeds the limit of {limit}")]
    TooLong {
        opcode: Opcode,
        length: u64,
        limit: u64,
    },
}

impl FrameError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub opcode: Opcode,
    pub request_id: u64,
    pub handle: u32,
    pub status: u32,
    pub offset: u64,
    pub length: u64,
}

impl Header {
    pub fn new(opcode: Opcode, request_id: u64) -> Self {
        Header {
            opcode,
            request_id,
            handle: 0,
            status: 0,
            offset: 0,
            length: 0,
        }
    }

    /// Length of the payload that follows this header on the wire (READ carries none: its
    /// `length` is the amount requested).
    pub fn payload_len(&self) -> u64 {
        match self.opcode {
            Opcode::Read | Opcode::OpenOk => 0,
            _ => self.length,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = VERSION;
        b[5] = self.opcode as u8;
        // b[6..8]: flags, zero.
        b[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        b[16..20].copy_from_slice(&self.handle.to_le_bytes());
        b[20..24].copy_from_slice(&self.status.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.length.to_le_bytes());
        b
    }

    /// Decode and validate a header. `max_data` bounds WRITE/READ/READ_DATA lengths.
    pub fn decode(buf: &[u8], max_data: u64) -> Result<Header, FrameError> {
        let b: &[u8; HEADER_LEN] = buf
            .get(..HEADER_LEN)
            .and_then(|s| s.try_into().ok())
            .ok_or(FrameError::Truncated { got: buf.len() })?;
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if b[4] != VERSION {
            return Err(FrameError::BadVersion(b[4]));
        }
        let opcode = Opcode::from_u8(b[5]).ok_or(FrameError::UnknownOpcode(b[5]))?;
        let flags = u16::from_le_bytes([b[6], b[7]]);
        if flags != 0 {
            return Err(FrameError::BadFlags(flags));
        }
        let header = Header {
            opcode,
            request_id: u64_at(8),
            handle: u32_at(16),
            status: u32_at(20),
            offset: u64_at(24),
            length: u64_at(32),
        };
        let limit = match opcode {
            Opcode::OpenOk => super::memory::MAX_SEGMENT_SIZE as u64,
            Opcode::Read => max_data,
            // The range table travels in front of the data.
            Opcode::WriteV => max_data.saturating_add((MAX_RANGES * RANGE_ENTRY_LEN) as u64),
            op if op.carries_data() => max_data,
            _ => MAX_CONTROL_PAYLOAD,
        };
        if header.length > limit {
            return Err(FrameError::TooLong {
                opcode,
                length: header.length,
                limit,
            });
        }
        Ok(header)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_opcode() -> impl Strategy<Value = Opcode> {
        (1u8..=17).prop_map(|v| Opcode::from_u8(v).unwrap())
    }

    proptest! {
        #[test]
        fn encode_decode_round_trips(op in any_opcode(), id: u64, handle: u32, status: u32,
                                     offset: u64, length in 0u64..=MAX_CONTROL_PAYLOAD) {
            let h = Header { opcode: op, request_id: id, handle, status, offset, length };
            prop_assert_eq!(Header::decode(&h.encode(), DEFAULT_MAX_SLICE), Ok(h));
        }

        #[test]
        fn decoder_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Header::decode(&bytes, DEFAULT_MAX_SLICE);
        }

        #[test]
        fn truncated_headers_are_rejected(op in any_opcode(), cut in 0usize..HEADER_LEN) {
            let enc = Header::new(op, 7).encode();
            prop_assert_eq!(Header::decode(&enc[..cut], DEFAULT_MAX_SLICE),
                            Err(FrameError::Truncated { got: cut }));
        }

        #[test]
        fn unknown_opcodes_are_rejected(op in 18u8..=255) {
            let mut enc = Header::new(Opcode::Read, 1).encode();
            enc[5] = op;
            prop_assert_eq!(Header::decode(&enc, DEFAULT_MAX_SLICE), Err(FrameError::UnknownOpcode(op)));
        }

        #[test]
        fn oversized_lengths_are_rejected(op in any_opcode(), extra in 1u64..u64::MAX / 2) {
            let mut h = Header::new(op, 1);
            let limit = match op {
                Opcode::Write | Opcode::ReadData | Opcode::Read => DEFAULT_MAX_SLICE,
                Opcode::OpenOk => crate::memory::MAX_SEGMENT_SIZE as u64,
                Opcode::WriteV => DEFAULT_MAX_SLICE + (MAX_RANGES * RANGE_ENTRY_LEN) as u64,
                _ => MAX_CONTROL_PAYLOAD,
            };
            h.length = limit + extra;
            let rejected = matches!(
                Header::decode(&h.encode(), DEFAULT_MAX_SLICE),
                Err(FrameError::TooLong { .. })
            );
            prop_assert!(rejected);
        }
    }

    #[test]
    fn error_codes_keep_their_wire_values_and_names() {
        let codes = [
            (1, ErrorCode::Malformed, "malformed"),
            (2, ErrorCode::Unauthenticated, "unauthenticated"),
            (3, ErrorCode::UnknownSegment, "unknown_segment"),
            (4, ErrorCode::OutOfBounds, "out_of_bounds"),
            (5, ErrorCode::TooLarge, "too_large"),
            (6, ErrorCode::Unsupported, "unsupported"),
            (7, ErrorCode::Internal, "internal"),
            (8, ErrorCode::Integrity, "integrity"),
            (9, ErrorCode::Tls, "tls"),
        ];
        for (v, code, name) in codes {
            assert_eq!(
                (ErrorCode::from_u32(v), code as u32, code.as_str()),
                (code, v, name)
            );
        }
        assert_eq!(ErrorCode::from_u32(0), ErrorCode::Internal);
        assert_eq!(ErrorCode::from_u32(99), ErrorCode::Internal);
        assert_eq!(Opcode::from_u8(0), None);
        assert_eq!(Opcode::from_u8(15), Some(Opcode::RdmaConnectOk));
        assert_eq!(Opcode::from_u8(16), Some(Opcode::ReadV));
        assert_eq!(Opcode::from_u8(17), Some(Opcode::WriteV));
    }

    proptest! {
        #[test]
        fn range_tables_round_trip(ranges in proptest::collection::vec((any::<u64>(), 0u64..1 << 20), 1..=MAX_RANGES)) {
            let table = encode_ranges(ranges.iter().copied());
            let total: u64 = ranges.iter().map(|r| r.1).sum();
            let got = decode_ranges(ranges.len() as u64, &table, u64::MAX);
            prop_assert_eq!(got, Ok((ranges.clone(), total)));
        }

        #[test]
        fn range_decoder_never_panics(count: u64, table in proptest::collection::vec(any::<u8>(), 0..600), max: u64) {
            let _ = decode_ranges(count, &table, max);
        }
    }

    #[test]
    fn bad_range_tables_are_rejected() {
        let one = encode_ranges([(0, 10)]);
        assert_eq!(decode_ranges(0, &[], 100), Err(RangeError::Count(0)));
        assert_eq!(
            decode_ranges(MAX_RANGES as u64 + 1, &[], 100),
            Err(RangeError::Count(MAX_RANGES as u64 + 1))
        );
        assert_eq!(
            decode_ranges(2, &one, 100),
            Err(RangeError::TableLength { count: 2, got: 16 })
        );
        assert_eq!(
            decode_ranges(1, &one, 9),
            Err(RangeError::TooLarge { limit: 9 })
        );
        // Lengths that overflow a u64 when added are refused, not wrapped.
        let huge = encode_ranges([(0, u64::MAX), (0, 2)]);
        assert_eq!(
            decode_ranges(2, &huge, u64::MAX),
            Err(RangeError::TooLarge { limit: u64::MAX })
        );
    }

    #[test]
    fn bad_magic_version_and_flags_are_rejected() {
        let good = Header::new(Opcode::Hello, 1).encode();
        let mut b = good;
        b[0] ^= 1;
        assert!(matches!(
            Header::decode(&b, 1),
            Err(FrameError::BadMagic(_))
        ));
        let mut b = good;
        b[4] = 2;
        assert_eq!(Header::decode(&b, 1), Err(FrameError::BadVersion(2)));
        let mut b = good;
        b[7] = 1;
        assert_eq!(Header::decode(&b, 1), Err(FrameError::BadFlags(0x100)));
    }
}
