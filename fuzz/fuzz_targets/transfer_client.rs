//! The transfer engine's initiator reading a target's replies (`ReplyReader`: the inline
//! path's reply parsing) from a real socket whose peer sends the fuzz input. The first bytes
//! say which requests are in flight (up to 8 READs or WRITEs of up to 4 ranges each, their
//! lengths); the rest is what the target "answered". Every request gets one outcome, in
//! order, until the connection is given up, and only the last outcome may give it up.
#![no_main]

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::OnceLock;

use kvpool_transfer::{ExpectedReply, ReplyReader};
use libfuzzer_sys::fuzz_target;

const LOCAL: usize = 256 * 1024;

fn reader() -> &'static ReplyReader {
    static R: OnceLock<ReplyReader> = OnceLock::new();
    R.get_or_init(|| ReplyReader::new(LOCAL, 1 << 20).expect("reply reader"))
}

fuzz_target!(|data: &[u8]| {
    let [n, writes, rest @ ..] = data else {
        return;
    };
    let count = usize::from(n % 8) + 1;
    let mut rest = rest;
    let mut expected = Vec::with_capacity(count);
    for i in 0..count {
        let [shape, a, b, more @ ..] = rest else {
            return;
        };
        rest = more;
        let ranges = usize::from(shape % 4) + 1;
        // Range lengths 0..=8191 bytes: the whole batch fits the local segment.
        let len = u64::from(u16::from_le_bytes([*a, *b]) % 8192);
        expected.push(ExpectedReply {
            write: writes & (1 << i) != 0,
            lens: vec![len; ranges],
        });
    }
    // A socket buffer (200 KiB and more) holds any input libFuzzer makes here (4 KiB by default).
    let (mut target, mut initiator) = UnixStream::pair().expect("socket pair");
    target.write_all(rest).expect("write the replies");
    drop(target);
    let outcomes = reader().read(&mut initiator, &expected);
    assert!(outcomes.len() <= expected.len());
    if let Some((last, before)) = outcomes.split_last() {
        assert!(
            before.iter().all(|o| o.is_ok()),
            "the connection failed early"
        );
        if outcomes.len() < expected.len() {
            assert!(last.is_err(), "requests left without an outcome");
        }
    } else {
        panic!("no outcome for {} requests", expected.len());
    }
});
