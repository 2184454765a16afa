//! The records of `pool-ssd.idx` (magic `KVPPOOLX`): a put names a block (128-bit key digest,
//! offset, length, crc32c of its bytes), a drop names the block to forget (key, offset). Header,
//! framing and the walk over the log are the shared [`crate::ssd::log`]; this module encodes
//! the payloads and replays them into the live blocks, where a newer block supersedes every
//! older one whose bytes it overlaps. I/O boundary: none (pure).

use std::collections::BTreeMap;

use kvpool_core::master::ObjectKey;

use super::PoolBlock;
use crate::ssd::log;

pub(super) const MAGIC: &[u8; 8] = b"KVPPOOLX";
pub(super) const REC_PUT: u8 = 1;
pub(super) const REC_DROP: u8 = 2;
const PUT_LEN: usize = 1 + 16 + 8 + 8 + 4;
const DROP_LEN: usize = 1 + 16 + 8;

/// A replayed index: live blocks by offset, and whether the log ended cleanly.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Replayed {
    pub blocks: BTreeMap<u64, PoolBlock>,
    /// Byte position where a damaged tail starts, if any.
    pub damaged_at: Option<usize>,
}

/// Insert `b`, dropping every block whose bytes overlap it (the master reused those bytes, so
/// the older object there is gone).
pub(super) fn insert(blocks: &mut BTreeMap<u64, PoolBlock>, b: PoolBlock) {
    let end = b.offset.saturating_add(b.length.max(1));
    // Indexed blocks never overlap each other, so the ones `b` overlaps are the last ones
    // starting before its end.
    let doomed: Vec<u64> = blocks
        .range(..end)
        .rev()
        .take_while(|(_, o)| o.offset.saturating_add(o.length.max(1)) > b.offset)
        .map(|(k, _)| *k)
        .collect();
    for k in doomed {
        blocks.remove(&k);
    }
    blocks.insert(b.offset, b);
}

/// The framed record of kind `kind` ([`REC_PUT`] or [`REC_DROP`]) for `b`.
pub(super) fn encode(kind: u8, b: &PoolBlock) -> Vec<u8> {
    let mut p = Vec::with_capacity(PUT_LEN);
    p.push(kind);
    p.extend_from_slice(&b.key.hi.to_le_bytes());
    p.extend_from_slice(&b.key.lo.to_le_bytes());
    p.extend_from_slice(&b.offset.to_le_bytes());
    if kind == REC_PUT {
        p.extend_from_slice(&b.length.to_le_bytes());
        p.extend_from_slice(&b.crc.to_le_bytes());
    }
    log::record(&p)
}

fn u64_at(p: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(p.get(at..at + 8)?.try_into().ok()?))
}

/// A payload as (is a put, the block it names); `None` when it does not decode.
fn decode(p: &[u8]) -> Option<(bool, PoolBlock)> {
    let key = ObjectKey {
        hi: u64_at(p, 1)?,
        lo: u64_at(p, 9)?,
    };
    let offset = u64_at(p, 17)?;
    match (p.first()?, p.len()) {
        (&REC_PUT, PUT_LEN) => Some((
            true,
            PoolBlock {
                key,
                offset,
                length: u64_at(p, 25)?,
                crc: u32::from_le_bytes(p.get(33..37)?.try_into().ok()?),
            },
        )),
        (&REC_DROP, DROP_LEN) => Some((
            false,
            PoolBlock {
                key,
                offset,
                length: 0,
                crc: 0,
            },
        )),
        _ => None,
    }
}

/// Replay the records after the header. Pure. A record that is cut short, fails its checksum
/// or does not decode ends the replay there (a crash while appending).
pub fn replay(records: &[u8]) -> Replayed {
    let mut blocks = BTreeMap::new();
    let end = log::replay(records, |p| {
        let Some((put, block)) = decode(p) else {
            return false;
        };
        if put {
            insert(&mut blocks, block);
        } else if blocks
            .get(&block.offset)
            .is_some_and(|b: &PoolBlock| b.key == block.key)
        {
            blocks.remove(&block.offset);
        }
        true
    });
    Replayed {
        blocks,
        damaged_at: end.damaged.then_some(end.end),
    }
}
