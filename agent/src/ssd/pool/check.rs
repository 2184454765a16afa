//! Checking indexed blocks of the pool SSD segment against its data file: at start-up (bounds,
//! length, checksum, [`check_block`]) and before every read while the agent runs
//! ([`BlockChecker`], with its own file handle so the check runs outside the index's lock).
//! I/O boundary: reads of `pool-ssd.dat`.

use std::fs::File;
use std::path::PathBuf;

use super::{DropReason, PoolBlock, PoolIndexError};
use crate::ssd::log;

/// `None` when the bytes of `b` in `data` match its checksum, else why not; `Err` when the
/// file cannot be read for another reason than being too short.
fn check_crc(data: &File, b: &PoolBlock) -> std::io::Result<Option<DropReason>> {
    match log::crc_of_file(data, b.offset, b.length) {
        Ok(crc) => Ok((crc != b.crc).then_some(DropReason::Corrupt)),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(Some(DropReason::Truncated)),
        Err(e) => Err(e),
    }
}

/// Check one block against the data file (`data_len` bytes long, the segment `capacity`
/// bytes): bounds, length, checksum.
pub(super) fn check_block(
    data: &File,
    data_len: u64,
    capacity: u64,
    b: &PoolBlock,
) -> std::io::Result<Option<DropReason>> {
    let Some(end) = b.offset.checked_add(b.length) else {
        return Ok(Some(DropReason::OutOfBounds));
    };
    if b.length == 0 || end > capacity {
        return Ok(Some(DropReason::OutOfBounds));
    }
    if end > data_len {
        return Ok(Some(DropReason::Truncated));
    }
    check_crc(data, b)
}

/// Verifies indexed blocks against the data file (its own file handle, so the check runs
/// without holding the index's lock).
#[derive(Debug)]
pub struct BlockChecker {
    pub(super) data: File,
    pub(super) path: PathBuf,
}

impl BlockChecker {
    /// `None` when the bytes of `b` in the data file match its checksum, else why not.
    pub fn verify(&self, b: &PoolBlock) -> Result<Option<DropReason>, PoolIndexError> {
        check_crc(&self.data, b).map_err(|source| PoolIndexError::Read {
            path: self.path.clone(),
            source,
        })
    }
}
