//! The transfer engine's handshake from both ends, and the RDMA_CONNECT payloads that follow
//! it. The first input byte picks what is fuzzed:
//! - 0: the target's side reads the input as the initiator's HELLO and AUTH. It must never
//!   accept (the proof would have to bind the target's random nonce) and writes only a
//!   CHALLENGE or an ERROR.
//! - 1: the initiator's side reads the input as the target's CHALLENGE and AUTH_OK. It must
//!   never accept (the target's proof must bind the initiator's random nonce) and writes only
//!   its HELLO: no AUTH goes to a target that did not prove the key.
//! - 2, 3: `ConnectRequest` and `ConnectReply` (RDMA queue pairs); whatever decodes encodes
//!   back to the same bytes.
#![no_main]

use std::sync::OnceLock;

use kvpool_fuzz::{Duplex, KEY};
use kvpool_transfer::auth::NONCE_LEN;
use kvpool_transfer::frame::{HEADER_LEN, Header, Opcode};
use kvpool_transfer::rdma::handshake::{ConnectReply, ConnectRequest};
use kvpool_transfer::{AuthKey, MemoryTarget, wire};
use libfuzzer_sys::fuzz_target;

fn target() -> &'static MemoryTarget {
    static T: OnceLock<MemoryTarget> = OnceLock::new();
    T.get_or_init(|| MemoryTarget::new(4096, 1 << 20, key()).expect("memory target"))
}

fn key() -> AuthKey {
    AuthKey::new(KEY).expect("fuzz key")
}

/// The frames in `out`, each with its payload length checked.
fn frames(mut out: &[u8]) -> Vec<Header> {
    let mut v = Vec::new();
    while !out.is_empty() {
        let h = Header::decode(out, 0).expect("a malformed frame was written");
        let end = HEADER_LEN + h.payload_len() as usize;
        assert!(out.len() >= end, "payload cut short");
        out = &out[end..];
        v.push(h);
    }
    v
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    match which % 4 {
        0 => {
            let served = target().server_handshake(rest.to_vec());
            assert!(served.result.is_err(), "fuzz input passed the handshake");
            for h in frames(&served.output) {
                assert!(
                    matches!(h.opcode, Opcode::Challenge | Opcode::Error),
                    "{h:?}"
                );
            }
        }
        1 => {
            let mut conn = Duplex::new(rest);
            let result = wire::client_handshake(&mut conn, &key());
            assert!(result.is_err(), "fuzz input passed as a target");
            let sent = frames(&conn.output);
            assert_eq!(sent.len(), 1, "the initiator sent {sent:?}");
            assert_eq!(sent[0].opcode, Opcode::Hello);
            assert_eq!(sent[0].length, NONCE_LEN as u64);
        }
        2 => {
            if let Ok(req) = ConnectRequest::decode(rest) {
                let again = req.encode().expect("a decoded request encodes");
                assert_eq!(again, rest);
            }
        }
        _ => {
            if let Ok(reply) = ConnectReply::decode(rest) {
                let again = reply.encode().expect("a decoded reply encodes");
                assert_eq!(again, rest);
            }
        }
    }
});
