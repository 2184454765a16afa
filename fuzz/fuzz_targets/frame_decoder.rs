//! The transfer engine's 40-byte frame header and a vectored request's range table: any input
//! decodes or is rejected with an error; whatever decodes re-encodes to the same bytes, and
//! every length it declares is within the caps of its opcode.
#![no_main]

use kvpool_transfer::frame::{
    DEFAULT_MAX_SLICE, HEADER_LEN, Header, MAX_CONTROL_PAYLOAD, MAX_RANGES, Opcode,
    RANGE_ENTRY_LEN, decode_ranges, encode_ranges,
};
use kvpool_transfer::memory::MAX_SEGMENT_SIZE;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Header::decode(data, DEFAULT_MAX_SLICE) {
        assert_eq!(&h.encode()[..], &data[..HEADER_LEN]);
        let cap = match h.opcode {
            Opcode::OpenOk => MAX_SEGMENT_SIZE as u64,
            Opcode::Write | Opcode::ReadData | Opcode::Read => DEFAULT_MAX_SLICE,
            Opcode::WriteV => DEFAULT_MAX_SLICE + (MAX_RANGES * RANGE_ENTRY_LEN) as u64,
            _ => MAX_CONTROL_PAYLOAD,
        };
        assert!(h.length <= cap, "{h:?} exceeds {cap}");
        assert!(h.payload_len() <= h.length);
        // What follows the header, read as the range table of `offset` ranges.
        let table = &data[HEADER_LEN..];
        if let Ok((ranges, total)) = decode_ranges(h.offset, table, DEFAULT_MAX_SLICE) {
            assert_eq!(ranges.len() as u64, h.offset);
            assert!(total <= DEFAULT_MAX_SLICE);
            assert_eq!(ranges.iter().map(|r| r.1).sum::<u64>(), total);
            assert_eq!(encode_ranges(ranges.iter().copied()), table);
        }
    }
});
