//! Block keys: a request's token ids cut into fixed-size blocks whose keys are chained hashes, so
//! that equal prefixes give equal keys on every node. Pure; no I/O.
//!
//! Key `i` is xxh3-64 of block `i`'s token ids (little-endian `u32`s) seeded with key `i - 1`
//! (seed 0 for the first block). A key therefore names the whole prefix up to the end of its
//! block, exactly like the `hash_ids` of the Mooncake traces.

use std::num::NonZeroU32;

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Key of one block: a hash that covers this block's tokens and every token before it.
pub type BlockKey = u64;

/// Seed of the first block's hash.
pub const CHAIN_SEED: u64 = 0;

/// Name of a block in the pool (the master's key) for the engines serving `model`:
/// `kvpool/synthetic/<model>/<key as 16 lowercase hex digits>`. The one naming contract shared
/// by the engines that write blocks (the synthetic engine, real engines' connectors) and the
/// conductor that asks the master which blocks exist (docs/engine-contract.md).
pub fn pool_key(model: &str, key: BlockKey) -> Vec<u8> {
    format!("kvpool/synthetic/{model}/{key:016x}").into_bytes()
}

/// Number of blocks (the last one possibly partial) that `tokens` tokens occupy.
pub fn block_count(tokens: u64, block_size: NonZeroU32) -> u64 {
    tokens.div_ceil(u64::from(block_size.get()))
}

/// Chained keys of `tokens` cut into blocks of `block_size` tokens; the last block may be
/// partial. Empty input gives no keys.
pub fn block_keys(tokens: &[u32], block_size: NonZeroU32) -> Vec<BlockKey> {
    let size = block_size.get() as usize;
    let mut keys = Vec::with_capacity(tokens.len().div_ceil(size));
    let mut bytes = Vec::with_capacity(size * 4);
    let mut prev = CHAIN_SEED;
    for chunk in tokens.chunks(size) {
        bytes.clear();
        for token in chunk {
            bytes.extend_from_slice(&token.to_le_bytes());
        }
        prev = xxh3_64_with_seed(&bytes, prev);
        keys.push(prev);
    }
    keys
}

/// Stand-in token ids for text when no tokenizer is configured: the UTF-8 bytes cut into
/// `chunk_bytes`-byte chunks, each hashed to a `u32`. Equal text prefixes give equal ids, so
/// block keys and prefix caching behave as with a real tokenizer; the count approximates one
/// token per `chunk_bytes` bytes (4 is typical of English text).
pub fn text_tokens(text: &str, chunk_bytes: usize) -> Vec<u32> {
    text.as_bytes()
        .chunks(chunk_bytes.max(1))
        .map(|c| xxh3_64_with_seed(c, 0) as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bs(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).unwrap()
    }

    #[test]
    fn keys_match_hand_computed_chain() {
        let keys = block_keys(&[1, 2, 3, 4, 5], bs(2));
        let k0 = xxh3_64_with_seed(&[1, 0, 0, 0, 2, 0, 0, 0], 0);
        let k1 = xxh3_64_with_seed(&[3, 0, 0, 0, 4, 0, 0, 0], k0);
        let k2 = xxh3_64_with_seed(&[5, 0, 0, 0], k1);
        assert_eq!(keys, vec![k0, k1, k2]);
    }

    #[test]
    fn equal_prefixes_share_keys_and_divergence_changes_all_later_keys() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[17] = 999; // inside block 2 (tokens 16..24)
        let ka = block_keys(&a, bs(8));
        let kb = block_keys(&b, bs(8));
        assert_eq!(ka.len(), 5);
        assert_eq!(ka[..2], kb[..2]);
        for i in 2..5 {
            assert_ne!(ka[i], kb[i], "block {i}");
        }
        // The same block content after a different prefix gets a different key.
        let mut c = a.clone();
        c[0] = 7;
        let kc = block_keys(&c, bs(8));
        assert_ne!(ka[4], kc[4]);
    }

    #[test]
    fn text_tokens_chunk_and_share_prefixes() {
        let a = text_tokens("hello world!", 4);
        assert_eq!(a.len(), 3);
        assert_eq!(a[0], xxh3_64_with_seed(b"hell", 0) as u32);
        let b = text_tokens("hello there", 4);
        assert_eq!(a[..1], b[..1]);
        assert_ne!(a[1], b[1]);
        assert_eq!(text_tokens("abcde", 4).len(), 2);
        assert!(text_tokens("", 4).is_empty());
    }

    #[test]
    fn empty_and_counts() {
        assert!(block_keys(&[], bs(4)).is_empty());
        assert_eq!(block_count(0, bs(512)), 0);
        assert_eq!(block_count(512, bs(512)), 1);
        assert_eq!(block_count(513, bs(512)), 2);
        assert_eq!(block_count(6758, bs(512)), 14);
    }

    #[test]
    fn pool_key_is_the_documented_name() {
        assert_eq!(
            pool_key("llama", 0x00ab_cdef_0123_4567),
            b"kvpool/synthetic/llama/00abcdef01234567".to_vec()
        );
        assert_eq!(
            pool_key("m", u64::MAX),
            b"kvpool/synthetic/m/ffffffffffffffff".to_vec()
        );
    }
}
