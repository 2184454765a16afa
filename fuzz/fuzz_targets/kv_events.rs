//! KV cache events as engines publish them (vLLM's msgpack batches, and the 8-byte sequence
//! frame before each): whatever decodes re-encodes, in both encodings, to bytes that decode
//! to the same batch.
#![no_main]

use kvpool_proto::kv_events::{Encoding, decode_batch, decode_sequence, encode_batch};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match decode_sequence(data) {
        Ok(seq) => assert_eq!(seq.to_be_bytes(), data),
        Err(_) => assert_ne!(data.len(), 8),
    }
    if let Ok(batch) = decode_batch(data) {
        for enc in [Encoding::Array, Encoding::Map] {
            let bytes = encode_batch(&batch, enc);
            let again = decode_batch(&bytes).expect("a re-encoded batch decodes");
            // Compared as bytes: a NaN timestamp is not equal to itself.
            assert_eq!(encode_batch(&again, enc), bytes);
            assert_eq!(again.events, batch.events);
        }
    }
});
