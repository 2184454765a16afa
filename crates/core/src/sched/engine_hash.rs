//! Engine block hashes: a prompt's blocks keyed the way vLLM keys its prefix cache, so that the
//! block hashes an engine publishes in its KV events and the keys the conductor computes for a
//! request are the same numbers. Pure; no I/O.
//!
//! vLLM (v1 engine, `--prefix-caching-hash-algo sha256_cbor`) hashes only full blocks. Block `i`'s
//! hash is SHA-256 of the canonical CBOR encoding of the triple
//! `(parent, token_ids, extra_keys)`: `parent` is block `i - 1`'s 32-byte hash (a CBOR byte
//! string), or for the first block the seed hash, SHA-256 of the CBOR text string of
//! `PYTHONHASHSEED`; `token_ids` is the block's token ids (a CBOR array of unsigned integers);
//! `extra_keys` is CBOR null for a plain text request, or an array (the LoRA adapter's name,
//! for example). The KV events carry either the 32 raw bytes or, with vLLM's default
//! `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the integer formed by the hash's last 8 bytes read
//! big-endian: [`EngineHash::as_u64`], which is also the conductor's [`BlockKey`].
//!
//! SGLang's radix cache publishes the same event shape with its own integer hashes; an engine
//! whose hashes cannot be recomputed still feeds the index through its events, but only the
//! conductor's own keys (then unrelated to the engine's) are looked up for new requests
//! (docs/scheduling.md, "Engine block hashes").

use std::num::NonZeroU32;

use sha2::{Digest, Sha256};

use super::blocks::BlockKey;

/// vLLM's default block size (tokens per KV block) on GPUs.
pub const VLLM_DEFAULT_BLOCK_SIZE: u32 = 16;

/// One block's 32-byte hash as the engine computes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EngineHash(pub [u8; 32]);

impl EngineHash {
    /// The integer form vLLM publishes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`): the last 8
    /// bytes, big-endian.
    pub fn as_u64(&self) -> BlockKey {
        u64_of_hash_bytes(&self.0)
    }

    /// Lowercase hex of the 32 bytes.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }
}

/// The conductor's key of a block hash published as raw bytes: the last 8 bytes read big-endian
/// (what vLLM's integer form is); shorter inputs are zero-extended on the left.
pub fn u64_of_hash_bytes(bytes: &[u8]) -> BlockKey {
    let tail = &bytes[bytes.len().saturating_sub(8)..];
    tail.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
}

/// Extra keys of a request's blocks (what vLLM passes as `extra_keys`): none for a plain
/// request, or the LoRA adapter's name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExtraKeys<'a> {
    /// The LoRA adapter the request uses (vLLM keys its blocks by the adapter's name).
    pub lora_name: Option<&'a str>,
}

/// vLLM's chained block hashing for one model's engines (their `PYTHONHASHSEED`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VllmHasher {
    seed_hash: EngineHash,
}

impl VllmHasher {
    /// Hashing with the engines' `PYTHONHASHSEED` (`seed`).
    pub fn new(seed: &str) -> Self {
        let mut cbor = Vec::with_capacity(seed.len() + 9);
        cbor_head(&mut cbor, MAJOR_TEXT, seed.len() as u64);
        cbor.extend_from_slice(seed.as_bytes());
        Self {
            seed_hash: EngineHash(Sha256::digest(&cbor).into()),
        }
    }

    /// The parent hash of every first block (vLLM's `NONE_HASH` for this seed).
    pub fn seed_hash(&self) -> EngineHash {
        self.seed_hash
    }

    /// The hashes of the full blocks of `tokens` cut into `block_size` tokens (a trailing
    /// partial block has none), first block first.
    pub fn block_hashes(
        &self,
        tokens: &[u32],
        block_size: NonZeroU32,
        extra: ExtraKeys<'_>,
    ) -> Vec<EngineHash> {
        let size = block_size.get() as usize;
        let mut out = Vec::with_capacity(tokens.len() / size);
        let mut parent = self.seed_hash;
        let mut cbor = Vec::with_capacity(48 + size * 5);
        for block in tokens.chunks_exact(size) {
            cbor.clear();
            encode_triple(&mut cbor, &parent, block, extra);
            parent = EngineHash(Sha256::digest(&cbor).into());
            out.push(parent);
        }
        out
    }
}

/// How prompt blocks are keyed: the engines' way (vLLM's hashes, full blocks only) or kvpool's
/// own xxh3 chain ([`super::block_keys`], the last partial block included).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlockHashing {
    Vllm(VllmHasher),
    Kvpool,
}

/// The `--block-hash` flag of the conductor and the engines: which [`BlockHashing`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum BlockHashKind {
    /// vLLM's sha256_cbor block hashes (full blocks only), seeded by PYTHONHASHSEED.
    Vllm,
    /// kvpool's own xxh3 chain.
    Kvpool,
}

impl BlockHashKind {
    /// The hashing this selects, with the engines' `seed` for vLLM's.
    pub fn hashing(self, seed: &str) -> BlockHashing {
        match self {
            BlockHashKind::Vllm => BlockHashing::vllm(seed),
            BlockHashKind::Kvpool => BlockHashing::Kvpool,
        }
    }
}

impl BlockHashing {
    /// vLLM's hashing with `seed`.
    pub fn vllm(seed: &str) -> Self {
        BlockHashing::Vllm(VllmHasher::new(seed))
    }

    /// The block keys of `tokens` (of a request without a LoRA adapter).
    pub fn keys(&self, tokens: &[u32], block_size: NonZeroU32) -> Vec<BlockKey> {
        match self {
            BlockHashing::Vllm(h) => h
                .block_hashes(tokens, block_size, ExtraKeys::default())
                .iter()
                .map(EngineHash::as_u64)
                .collect(),
            BlockHashing::Kvpool => super::block_keys(tokens, block_size),
        }
    }

    /// The engine's own block hashes of `tokens` (full blocks only), where this hashing
    /// computes them (vLLM's); `None` for kvpool's chain, which has no engine hash.
    pub fn engine_hashes(&self, tokens: &[u32], block_size: NonZeroU32) -> Option<Vec<EngineHash>> {
        match self {
            BlockHashing::Vllm(h) => Some(h.block_hashes(tokens, block_size, ExtraKeys::default())),
            BlockHashing::Kvpool => None,
        }
    }

    /// Short name (the value of the `--block-hash` flags).
    pub fn name(&self) -> &'static str {
        match self {
            BlockHashing::Vllm(_) => "vllm",
            BlockHashing::Kvpool => "kvpool",
        }
    }
}

const MAJOR_UNSIGNED: u8 = 0;
const MAJOR_BYTES: u8 = 2;
const MAJOR_TEXT: u8 = 3;
const MAJOR_ARRAY: u8 = 4;
const CBOR_NULL: u8 = 0xf6;

/// A CBOR item head in its shortest form (what canonical CBOR requires).
fn cbor_head(out: &mut Vec<u8>, major: u8, n: u64) {
    let m = major << 5;
    match n {
        0..=23 => out.push(m | n as u8),
        24..=0xff => out.extend_from_slice(&[m | 24, n as u8]),
        0x100..=0xffff => {
            out.push(m | 25);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(m | 26);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
        _ => {
            out.push(m | 27);
            out.extend_from_slice(&n.to_be_bytes());
        }
    }
}

/// `(parent, tuple(token_ids), extra_keys)` as Python's `cbor2.dumps(..., canonical=True)`
/// writes it.
fn encode_triple(out: &mut Vec<u8>, parent: &EngineHash, block: &[u32], extra: ExtraKeys<'_>) {
    cbor_head(out, MAJOR_ARRAY, 3);
    cbor_head(out, MAJOR_BYTES, 32);
    out.extend_from_slice(&parent.0);
    cbor_head(out, MAJOR_ARRAY, block.len() as u64);
    for &t in block {
        cbor_head(out, MAJOR_UNSIGNED, u64::from(t));
    }
    match extra.lora_name {
        None => out.push(CBOR_NULL),
        Some(name) => {
            cbor_head(out, MAJOR_ARRAY, 1);
            cbor_head(out, MAJOR_TEXT, name.len() as u64);
            out.extend_from_slice(name.as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bs(size: u32) -> NonZeroU32 {
        NonZeroU32::new(size).expect("non-zero")
    }

    fn keys(seed: &str, tokens: &[u32], size: u32, extra: ExtraKeys<'_>) -> Vec<BlockKey> {
        VllmHasher::new(seed)
            .block_hashes(tokens, bs(size), extra)
            .iter()
            .map(EngineHash::as_u64)
            .collect()
    }

    #[test]
    fn cbor_heads_use_the_shortest_form() {
        let cases: [(u64, &[u8]); 6] = [
            (0, &[0x00]),
            (23, &[0x17]),
            (24, &[0x18, 24]),
            (255, &[0x18, 0xff]),
            (256, &[0x19, 0x01, 0x00]),
            (70_000, &[0x1a, 0x00, 0x01, 0x11, 0x70]),
        ];
        for (n, want) in cases {
            let mut out = Vec::new();
            cbor_head(&mut out, MAJOR_UNSIGNED, n);
            assert_eq!(out, want, "{n}");
        }
    }

    #[test]
    fn the_seed_hash_is_sha256_of_the_seed_as_a_cbor_text_string() {
        // cbor2.dumps("0") == b"\x610"
        let want: [u8; 32] = Sha256::digest([0x61, b'0']).into();
        assert_eq!(VllmHasher::new("0").seed_hash(), EngineHash(want));
    }

    #[test]
    fn only_full_blocks_are_hashed_and_the_chain_covers_the_prefix() {
        let h = BlockHashing::vllm("0");
        let tokens: Vec<u32> = (1..=10).collect();
        let keys = h.keys(&tokens, bs(4));
        assert_eq!(keys.len(), 2, "10 tokens make two full blocks of 4");
        let mut other = tokens.clone();
        other[5] = 99; // second block differs
        let k2 = h.keys(&other, bs(4));
        assert_eq!(keys[0], k2[0]);
        assert_ne!(keys[1], k2[1]);
        // The same second block after a different first block hashes differently.
        let mut first = tokens.clone();
        first[0] = 7;
        assert_ne!(h.keys(&first, bs(4))[1], keys[1]);
        // kvpool's own chain keys the partial block too.
        assert_eq!(BlockHashing::Kvpool.keys(&tokens, bs(4)).len(), 3);
    }

    #[test]
    fn lora_names_and_seeds_separate_hashes() {
        let tokens: Vec<u32> = (0..16).collect();
        let plain = keys("0", &tokens, 16, ExtraKeys::default());
        let lora = keys(
            "0",
            &tokens,
            16,
            ExtraKeys {
                lora_name: Some("adapter-a"),
            },
        );
        let seeded = keys("42", &tokens, 16, ExtraKeys::default());
        assert_ne!(plain, lora);
        assert_ne!(plain, seeded);
    }

    #[test]
    fn the_integer_form_is_the_last_eight_bytes_big_endian() {
        let mut bytes = [0u8; 32];
        bytes[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        assert_eq!(EngineHash(bytes).as_u64(), 0x0102_0304_0506_0708);
        assert_eq!(u64_of_hash_bytes(&[0x01, 0x02]), 0x0102);
        assert_eq!(u64_of_hash_bytes(&[]), 0);
        assert_eq!(EngineHash(bytes).to_hex().len(), 64);
    }
}
