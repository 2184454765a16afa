//! The durable-log mechanism both SSD indexes share. The local tier's `index.log` (`tier`) and
//! the pool segment's `pool-ssd.idx` (`pool`) are each a 16-byte header (8-byte magic, format
//! version as u32 LE, 4 reserved zero bytes) followed by records framed as
//! `payload length (u32 LE) | crc32c of the payload (u32 LE) | payload`; the two formats differ
//! only in their magic and their payloads, which each index encodes itself. Here, once for
//! both: the header, the framing, the replay of a log up to its first damaged record, the
//! atomic replacement of an index by a snapshot, and the crc32c of a byte range read chunk by
//! chunk. I/O boundary: [`write_atomically`] and [`crc_of_file`]; the rest is pure.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Bytes of the header before the first record.
pub const HEADER_LEN: usize = 16;
/// Bytes of a record's frame before its payload (length, checksum).
const FRAME_LEN: usize = 8;
/// Bytes read at once while checksumming a range.
pub const CHECK_CHUNK: usize = 1 << 20;

/// Why [`write_atomically`] failed.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum SnapshotError {
    /// Creating, writing, flushing or renaming the temporary file.
    #[error("writing the new index failed")]
    Write(#[source] std::io::Error),
    /// Flushing the directory after the rename.
    #[error("flushing the index directory failed")]
    SyncDir(#[source] std::io::Error),
}

kvpool_runtime::error_category!(SnapshotError);

/// The header of a log in format `version` of the index named by `magic`.
pub fn header(magic: &[u8; 8], version: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_LEN);
    h.extend_from_slice(magic);
    h.extend_from_slice(&version.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h
}

/// What the start of a (non-empty) index file says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Header {
    /// It does not start with the index's magic: not this kind of index.
    Foreign,
    /// The magic, but the file ends before the version.
    Short,
    /// The format version written after the magic (checking it is the caller's business).
    Version(u32),
}

/// Read the header at the start of `bytes`, expecting `magic`. Pure.
pub fn read_header(bytes: &[u8], magic: &[u8; 8]) -> Header {
    if bytes.get(..magic.len()) != Some(&magic[..]) {
        return Header::Foreign;
    }
    bytes
        .get(8..12)
        .and_then(|b| b.try_into().ok())
        .map_or(Header::Short, |b| Header::Version(u32::from_le_bytes(b)))
}

/// Append `payload` to `out` as one framed record.
pub fn push_record(out: &mut Vec<u8>, payload: &[u8]) {
    let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(payload).to_le_bytes());
    out.extend_from_slice(payload);
}

/// `payload` as one framed record.
pub fn record(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + FRAME_LEN);
    push_record(&mut out, payload);
    out
}

/// Where [`replay`] stopped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Replay {
    /// Records accepted.
    pub records: u64,
    /// Position (in the replayed bytes) right after the last accepted record: where the
    /// damaged tail starts when there is one, else the length of the log.
    pub end: usize,
    /// The replay stopped at a damaged record rather than at the end of the log.
    pub damaged: bool,
}

/// Hand the payload of each framed record of `log` (the bytes after the header) to `apply`,
/// in order, until the log ends or a record is cut short, fails its checksum or is refused by
/// `apply` (it returns false: the payload does not decode). A crash while appending leaves
/// such a tail; it is ignored. Pure.
pub fn replay(log: &[u8], mut apply: impl FnMut(&[u8]) -> bool) -> Replay {
    let mut out = Replay::default();
    while out.end < log.len() {
        let pos = out.end;
        let payload = (|| {
            let len = u32::from_le_bytes(log.get(pos..pos + 4)?.try_into().ok()?) as usize;
            let crc = u32::from_le_bytes(log.get(pos + 4..pos + FRAME_LEN)?.try_into().ok()?);
            let payload = log.get(pos + FRAME_LEN..pos + FRAME_LEN + len)?;
            (crc32c::crc32c(payload) == crc).then_some(payload)
        })();
        match payload {
            Some(p) if apply(p) => {
                out.records += 1;
                out.end = pos + FRAME_LEN + p.len();
            }
            _ => {
                out.damaged = true;
                break;
            }
        }
    }
    out
}

/// Replace the file at `path` by `bytes` atomically: write them to `tmp` (in the same
/// directory `dir`), fsync it, rename it over `path`, then fsync `dir` (skipped when the
/// directory cannot be opened).
pub fn write_atomically(
    dir: &Path,
    tmp: &Path,
    path: &Path,
    bytes: &[u8],
) -> Result<(), SnapshotError> {
    let mut f = File::create(tmp).map_err(SnapshotError::Write)?;
    f.write_all(bytes).map_err(SnapshotError::Write)?;
    f.sync_all().map_err(SnapshotError::Write)?;
    std::fs::rename(tmp, path).map_err(SnapshotError::Write)?;
    if let Ok(d) = File::open(dir) {
        d.sync_all().map_err(SnapshotError::SyncDir)?;
    }
    Ok(())
}

/// crc32c of the `length` bytes at `offset`, which `read(position, buffer)` fills, at most
/// [`CHECK_CHUNK`] bytes at a time.
pub fn crc_of_range<E>(
    offset: u64,
    length: u64,
    mut read: impl FnMut(u64, &mut [u8]) -> Result<(), E>,
) -> Result<u32, E> {
    let mut buf = vec![0u8; CHECK_CHUNK.min(usize::try_from(length).unwrap_or(CHECK_CHUNK))];
    let mut crc = 0u32;
    let mut done = 0u64;
    while done < length {
        let n = usize::try_from(length - done)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let chunk = buf.get_mut(..n).unwrap_or_default();
        read(offset + done, chunk)?;
        crc = crc32c::crc32c_append(crc, chunk);
        done += n as u64;
    }
    Ok(crc)
}

/// crc32c of the `length` bytes of `data` at `offset`. A file shorter than the range fails
/// with `UnexpectedEof`.
pub fn crc_of_file(data: &File, offset: u64, length: u64) -> std::io::Result<u32> {
    offset
        .checked_add(length)
        .ok_or_else(|| std::io::Error::other("block range overflows"))?;
    crc_of_range(offset, length, |pos, chunk| data.read_exact_at(chunk, pos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_replay_in_order_until_a_damaged_one() {
        let mut log = Vec::new();
        for p in [&b"one"[..], b"", b"three"] {
            push_record(&mut log, p);
        }
        assert_eq!(record(b"one"), log[..11].to_vec());
        let mut seen = Vec::new();
        let r = replay(&log, |p| {
            seen.push(p.to_vec());
            true
        });
        assert_eq!(seen, vec![b"one".to_vec(), Vec::new(), b"three".to_vec()]);
        assert_eq!(
            r,
            Replay {
                records: 3,
                end: log.len(),
                damaged: false
            }
        );
        // Cut short, a flipped byte, a refused payload: the replay stops before that record.
        let cut = replay(&log[..log.len() - 1], |_| true);
        assert_eq!((cut.records, cut.end, cut.damaged), (2, 19, true));
        let mut flipped = log.clone();
        flipped[9] ^= 0xff;
        assert_eq!(replay(&flipped, |_| true).records, 0);
        let refused = replay(&log, |p| p != b"three");
        assert_eq!(
            (refused.records, refused.end, refused.damaged),
            (2, 19, true)
        );
    }

    #[test]
    fn headers_name_their_index_and_version() {
        let h = header(b"KVPTESTX", 7);
        assert_eq!(h.len(), HEADER_LEN);
        assert_eq!(read_header(&h, b"KVPTESTX"), Header::Version(7));
        assert_eq!(read_header(&h, b"KVPOTHER"), Header::Foreign);
        assert_eq!(read_header(&h[..10], b"KVPTESTX"), Header::Short);
    }

    #[test]
    fn range_checksums_match_one_pass_over_the_bytes() {
        let bytes: Vec<u8> = (0..(CHECK_CHUNK * 2 + 5))
            .map(|i| (i % 251) as u8)
            .collect();
        let read = |pos: u64, chunk: &mut [u8]| {
            let at = usize::try_from(pos).map_err(|_| ())?;
            chunk.copy_from_slice(bytes.get(at..at + chunk.len()).ok_or(())?);
            Ok::<(), ()>(())
        };
        let len = bytes.len() as u64 - 3;
        assert_eq!(crc_of_range(3, len, read), Ok(crc32c::crc32c(&bytes[3..])));
        assert_eq!(crc_of_range(0, 0, read), Ok(0));
        assert_eq!(crc_of_range(3, len + 1, read), Err(()));
    }
}
