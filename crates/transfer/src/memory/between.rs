//! Copies between two segments (the same-node shared-memory data path), host or device, and
//! the adoption of descriptors received with SCM_RIGHTS. I/O boundary: the copies (through
//! `checked` for caller memory) and taking ownership of received descriptors.

use std::io;
use std::os::fd::OwnedFd;

use super::{MemoryError, Segment, checked, device};

/// Copy `len` bytes between two segments (the same-node shared-memory data path).
pub fn copy_between(
    src: &Segment,
    src_offset: u64,
    dst: &Segment,
    dst_offset: u64,
    len: usize,
) -> Result<(), MemoryError> {
    copy_between_in(src, src_offset, dst, dst_offset, len, false)
}

/// One copy of a batch for [`vouch_copies`]: source, its offset, destination, its offset,
/// length.
pub type BatchCopy<'a> = (&'a Segment, u64, &'a Segment, u64, usize);

/// Ask the kernel once for the caller memory (registered, not mapped here) of a batch of
/// copies (`checked::vouch_all`). True: every copy of the batch may then go through
/// [`copy_between_in`] with `vouched`, without a check of its own; false: each checks itself.
pub fn vouch_copies<'a>(copies: impl Iterator<Item = BatchCopy<'a>>) -> bool {
    let mut ranges = Vec::new();
    for (src, so, dst, dof, len) in copies {
        for (seg, off, write) in [(src, so, false), (dst, dof, true)] {
            if !seg.is_foreign() {
                continue;
            }
            let Ok(p) = seg.ptr_at(off, len) else {
                return false;
            };
            ranges.push(checked::CallerRange {
                addr: p as usize,
                len,
                write,
            });
        }
    }
    checked::vouch_all(&mut ranges)
}

/// [`copy_between`]; with `vouched`, the caller memory among the two sides was vouched for by
/// [`vouch_copies`] for a batch holding this copy, and is not checked again.
pub fn copy_between_in(
    src: &Segment,
    src_offset: u64,
    dst: &Segment,
    dst_offset: u64,
    len: usize,
    vouched: bool,
) -> Result<(), MemoryError> {
    if let Some(dev) = src.device_memory_backing() {
        // Device to anywhere: stream the source's chunks into the destination.
        src.check_range(src_offset, len as u64)?;
        dst.check_range(dst_offset, len as u64)?;
        let mut at = dst_offset;
        return device::stream_out(dev, src_offset, len, |buf| {
            dst.write_at(at, buf).map_err(io::Error::other)?;
            at += buf.len() as u64;
            Ok(())
        })
        .map_err(MemoryError::Staged);
    }
    if let Some(dev) = dst.device_memory_backing() {
        src.check_range(src_offset, len as u64)?;
        dst.check_range(dst_offset, len as u64)?;
        let mut at = src_offset;
        return device::stream_in(dev, dst_offset, len, |buf| {
            src.read_at(at, buf).map_err(io::Error::other)?;
            at += buf.len() as u64;
            Ok(())
        })
        .map_err(MemoryError::Staged);
    }
    let s = src.ptr_at(src_offset, len)?;
    let d = dst.ptr_at(dst_offset, len)?;
    src.prefault(src_offset, len);
    dst.prefault(dst_offset, len);
    if src.is_foreign() || dst.is_foreign() {
        let check = if vouched {
            checked::Check::NONE
        } else {
            checked::Check {
                dst: dst.is_foreign(),
                src: src.is_foreign(),
            }
        };
        // SAFETY: both ranges are inside their segments (checked); the kernel checks that the
        // caller memory among them is still mapped (here, or for the whole batch just before:
        // `vouched`), the others are segments' own mappings.
        return unsafe { checked::copy(d, s, len, check) }.map_err(MemoryError::Fault);
    }
    // SAFETY: both ranges are inside their segments (checked). They may overlap when both name
    // the same memory (a process reading from its own segment through the shm path), so use
    // `copy` (memmove) rather than `copy_nonoverlapping`.
    unsafe { std::ptr::copy(s, d, len) };
    Ok(())
}

/// Take ownership of descriptors that `recvmsg` installed from an SCM_RIGHTS message.
///
/// Only pass descriptors straight out of a `ControlMessageOwned::ScmRights` of a message this
/// process just received: the kernel created them for us and nothing else owns them.
pub(crate) fn adopt_received_fds(raw: Vec<std::os::fd::RawFd>) -> Vec<OwnedFd> {
    raw.into_iter()
        .filter(|fd| *fd >= 0)
        .map(|fd| {
            use std::os::fd::FromRawFd;
            // SAFETY: per the contract above, `fd` is a fresh descriptor installed by the kernel
            // for this process and owned by nobody else; it is wrapped exactly once.
            unsafe { OwnedFd::from_raw_fd(fd) }
        })
        .collect()
}
