//! The region table of a point-to-point engine (`p2p`): how a peer learns which of this
//! process's memory is registered, so that it can address it as Mooncake's engine does, by
//! virtual address. Each engine keeps the table in a segment of its own, [`TABLE_SEGMENT`],
//! that peers read over the transfer engine (so the lookup is authenticated, and sealed or
//! encrypted, as every other transfer is). Layout, little-endian `u64`s: a header of
//! `[MAGIC, generation, count, checksum]`, then `count` entries of `[start, length, id]`; the
//! region with id `N` is served as the segment `region_segment(N)`. The checksum (FNV-1a over
//! the generation, the count and the entries) tells a reader that caught the table halfway
//! through an update to read it again. Pure: the caller moves the bytes.

use crate::errors::{Failure, Kind};

/// Name of the segment holding the table.
pub const TABLE_SEGMENT: &str = "mooncake-engine/regions";
/// Regions an engine registers at most.
pub const MAX_REGIONS: usize = 8192;
/// Header bytes.
pub const HEADER: usize = 32;
/// Bytes of one entry.
const ENTRY: usize = 24;
/// Size of the table segment.
pub const TABLE_BYTES: usize = HEADER + ENTRY * MAX_REGIONS;
/// First word of the header: "kvpoolRT".
const MAGIC: u64 = u64::from_le_bytes(*b"kvpoolRT");

/// One registered region: `start..start+len` of the owner's address space, served as the
/// segment `region_segment(id)`. Ids grow with each registration: the lowest is the oldest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub start: u64,
    pub len: u64,
    pub id: u64,
}

/// The segment name the region with id `id` is served as.
pub fn region_segment(id: u64) -> String {
    format!("mooncake-engine/region-{id}")
}

fn checksum(generation: u64, entries: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let count = (entries.len() / ENTRY) as u64;
    let words = generation
        .to_le_bytes()
        .into_iter()
        .chain(count.to_le_bytes());
    for b in words.chain(entries.iter().copied()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The table's bytes (header and entries) for `entries` at `generation`.
pub fn encode(generation: u64, entries: &[Entry]) -> Vec<u8> {
    let mut body = Vec::with_capacity(entries.len() * ENTRY);
    for e in entries {
        for w in [e.start, e.len, e.id] {
            body.extend_from_slice(&w.to_le_bytes());
        }
    }
    let mut out = Vec::with_capacity(HEADER + body.len());
    for w in [
        MAGIC,
        generation,
        entries.len() as u64,
        checksum(generation, &body),
    ] {
        out.extend_from_slice(&w.to_le_bytes());
    }
    out.extend_from_slice(&body);
    out
}

fn word(bytes: &[u8], i: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
    u64::from_le_bytes(w)
}

fn malformed(why: &str) -> Failure {
    Failure::new(
        Kind::TransferFailed,
        format!("the peer's region table is not a kvpool engine's: {why}"),
    )
}

/// The table's full length in bytes from its header (the first [`HEADER`] bytes).
pub fn table_len(header: &[u8]) -> Result<usize, Failure> {
    if header.len() < HEADER || word(header, 0) != MAGIC {
        return Err(malformed(
            "bad magic (is the peer a kvpool mooncake_engine?)",
        ));
    }
    let count = usize::try_from(word(header, 2))
        .ok()
        .filter(|c| *c <= MAX_REGIONS)
        .ok_or_else(|| malformed("too many regions"))?;
    Ok(HEADER + count * ENTRY)
}

/// The entries of a whole table; `None` when the checksum does not match (read during an
/// update: read again).
pub fn decode(bytes: &[u8]) -> Result<Option<Vec<Entry>>, Failure> {
    let len = table_len(bytes)?;
    if bytes.len() < len {
        return Err(malformed("shorter than its header says"));
    }
    let body = &bytes[HEADER..len];
    if checksum(word(bytes, 1), body) != word(bytes, 3) {
        return Ok(None);
    }
    Ok(Some(
        body.chunks_exact(ENTRY)
            .map(|c| Entry {
                start: word(c, 0),
                len: word(c, 1),
                id: word(c, 2),
            })
            .collect(),
    ))
}
