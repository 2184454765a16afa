//! Fuzz the transfer engine's frame header decoder: any input must decode or be rejected with a
//! `FrameError`, and whatever decodes must re-encode to the same 40 bytes.
#![no_main]

use kvpool_transfer::frame::{DEFAULT_MAX_SLICE, HEADER_LEN, Header};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Header::decode(data, DEFAULT_MAX_SLICE) {
        assert_eq!(&h.encode()[..], &data[..HEADER_LEN]);
    }
});
