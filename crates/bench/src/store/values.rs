//! The values a `kvpool bench store` worker puts: pseudo-random templates per size, each stamped
//! with the worker and object index so that a get proves it returned this object's bytes, and
//! the object keys. Pure but for reading a registered buffer in place.

use kvpool_transfer as transfer;

/// Bytes stamped at the start of every value to make it unique (worker id and index).
pub(super) const STAMP: usize = 16;

/// Pseudo-random bytes (xorshift), so that nothing on the path can shortcut on zero pages or
/// repeated content.
pub fn template(size: u64, seed: u64) -> Vec<u8> {
    kvpool_harness::bytes::pseudo_random(seed, size as usize)
}

pub(super) fn stamp(worker: usize, i: u64) -> [u8; STAMP] {
    let mut s = [0u8; STAMP];
    s[..8].copy_from_slice(&(worker as u64).to_le_bytes());
    s[8..].copy_from_slice(&i.to_le_bytes());
    s
}

/// Write the stamp of object `i` of `worker` over the start of `buf`.
pub(super) fn stamp_into(buf: &mut [u8], worker: usize, i: u64) {
    let s = stamp(worker, i);
    let n = buf.len().min(STAMP);
    buf[..n].copy_from_slice(&s[..n]);
}

/// Whether the start of registered buffer `seg` holds the value of object `i` of `worker`,
/// compared in place (no copy out of the buffer first).
pub(super) fn verify_segment(
    seg: &transfer::LocalSegment,
    tmpl: &[u8],
    worker: usize,
    i: u64,
) -> bool {
    let mem = seg.segment();
    if mem.check_range(0, tmpl.len() as u64).is_err() {
        return false;
    }
    // SAFETY: the range was checked to lie inside the segment's live mapping, which `seg` keeps
    // alive for the borrow. The buffer belongs to this benchmark task alone and the only writer,
    // the transport of its own `get_to`, has completed, so nothing writes these bytes while
    // the shared slice exists.
    let got = unsafe { std::slice::from_raw_parts(mem.addr() as *const u8, tmpl.len()) };
    verify(got, tmpl, worker, i)
}

/// Whether `got` is the value of object `i` of `worker` built on `tmpl`.
/// Whether the start of an engine-API staging area holds the value of object `i` of
/// `worker`, compared in place.
pub(super) fn verify_staging(
    staging: &kvpool_client::engine_api::shm::Staging,
    tmpl: &[u8],
    worker: usize,
    i: u64,
) -> bool {
    if !staging.contains(0, tmpl.len() as u64) {
        return false;
    }
    // SAFETY: the range lies inside the area's live mapping, which `staging` keeps alive for
    // the borrow; the area belongs to this benchmark slot alone and the agent's get into it
    // has completed, so nothing writes these bytes while the slice exists.
    let got = unsafe { std::slice::from_raw_parts(staging.as_ptr(), tmpl.len()) };
    verify(got, tmpl, worker, i)
}

pub fn verify(got: &[u8], tmpl: &[u8], worker: usize, i: u64) -> bool {
    if got.len() != tmpl.len() {
        return false;
    }
    let s = stamp(worker, i);
    let n = got.len().min(STAMP);
    got[..n] == s[..n] && got[n..] == tmpl[n..]
}

pub(super) fn object_key(worker: usize, size: u64, i: u64) -> Vec<u8> {
    format!("bench/w{worker}/s{size}/{i}").into_bytes()
}
