//! The transfer engine's target side after the handshake: the bytes of one connection go
//! through the production request loop (`MemoryTarget`, the `serve_requests` a TCP
//! connection runs) against a registered 64 KiB segment. Whatever comes in, what goes out
//! is a sequence of well-formed replies, no more than there were requests, none larger than
//! the slice limit, and OPEN_OK names the segment.
#![no_main]

use std::sync::OnceLock;

use kvpool_fuzz::KEY;
use kvpool_transfer::frame::{HEADER_LEN, Header, Opcode};
use kvpool_transfer::{AuthKey, MemoryTarget};
use libfuzzer_sys::fuzz_target;

const SEGMENT: usize = 64 * 1024;
const MAX_SLICE: u64 = 1 << 20;

fn target() -> &'static MemoryTarget {
    static T: OnceLock<MemoryTarget> = OnceLock::new();
    T.get_or_init(|| {
        let key = AuthKey::new(KEY).expect("fuzz key");
        MemoryTarget::new(SEGMENT, MAX_SLICE, key).expect("memory target")
    })
}

fuzz_target!(|data: &[u8]| {
    let t = target();
    let served = t.serve_requests(data.to_vec());
    let mut out = &served.output[..];
    let mut replies = 0usize;
    while !out.is_empty() {
        let h = Header::decode(out, MAX_SLICE).expect("the target wrote a malformed header");
        assert!(h.opcode.is_plain_reply(), "the target answered with {:?}", h.opcode);
        match h.opcode {
            // A READV's ranges are each inside the segment but may overlap, so together they
            // may exceed it; what bounds a reply is the slice limit.
            Opcode::ReadData => assert!(h.length <= MAX_SLICE, "a reply over the slice limit"),
            Opcode::OpenOk => {
                assert_eq!((h.handle, h.length), (t.handle(), t.segment_len()));
                assert_eq!(h.status, t.instance());
            }
            _ => {}
        }
        let end = HEADER_LEN + h.payload_len() as usize;
        assert!(out.len() >= end, "reply payload cut short");
        out = &out[end..];
        replies += 1;
    }
    assert!(
        replies <= data.len() / HEADER_LEN,
        "{replies} replies to {} bytes of requests",
        data.len()
    );
});
