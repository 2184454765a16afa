//! Copies of caller memory that the kernel checks: a range a caller registered may have been
//! unmapped (or never mapped) since, and a plain `memcpy` from it ends the process with
//! SIGSEGV. [`copy`] first asks the kernel to vouch for the caller's side of the copy:
//! `madvise(MADV_POPULATE_READ)` for a source, `MADV_POPULATE_WRITE` for a destination, which
//! fills the range's page-table entries as a read or write would, without copying anything,
//! and answers ENOMEM where part of the range is not mapped. Vouched for, the bytes move with
//! a plain copy; unmapped, the copy fails with EFAULT and touches nothing. Where the kernel
//! cannot vouch (EINVAL: mapped without that access, or a kernel before 5.14; EFAULT: memory
//! whose access would raise SIGBUS; memory it cannot populate), the copy goes through
//! `process_vm_readv` on this very process, which copies through the kernel's fault-handling
//! user copy and answers EFAULT for an address that is not mapped with the access the copy
//! needs. Where the kernel refuses that call too (a seccomp profile without it: EPERM or
//! ENOSYS), the copy falls back to `memcpy` and says so once.
//!
//! Why not `process_vm_readv` always: it pins and unpins every page of the other side for
//! each call, which measured here (8 MiB in 32 KiB pieces, a vLLM block load's shape) cost
//! 1.6 ms against 1.0 ms for a plain copy; the check first and a plain copy cost 1.15 ms.
//! A batch of copies on the shared-memory path asks once for all of its caller memory
//! ([`vouch_all`]: touching ranges merged, one call per merged range) and falls back to a
//! check per copy when that answer is anything but yes.
//! What the check cannot cover: memory that another thread of the caller unmaps *while* a
//! transfer into or out of it runs (between the check and the copy). That is a race in the
//! caller, as freeing a buffer that a store is still filling is with any store; a buffer
//! unmapped before the call is always an error, never a signal.
//!
//! I/O boundary: the `madvise` and `process_vm_readv` system calls.

use std::io;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::libc;

/// Set once `process_vm_readv` was refused by the kernel: later copies go straight to memcpy.
static UNAVAILABLE: AtomicBool = AtomicBool::new(false);

/// `madvise` advice (Linux 5.14); spelled out, the libc crate may not have them.
const MADV_POPULATE_READ: libc::c_int = 22;
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Whether this kernel populates ranges on request (asked once, [`populate_works`]).
static POPULATE: OnceLock<bool> = OnceLock::new();

/// Which ranges of a copy are caller memory, for the kernel to vouch for (the others are
/// memory this process mapped itself and keeps mapped: a segment, a staging area).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Check {
    pub dst: bool,
    pub src: bool,
}

impl Check {
    /// The destination is caller memory.
    pub const DST: Check = Check {
        dst: true,
        src: false,
    };
    /// The source is caller memory.
    pub const SRC: Check = Check {
        dst: false,
        src: true,
    };
    /// Neither: the kernel has vouched for the whole batch already ([`vouch_all`]).
    pub const NONE: Check = Check {
        dst: false,
        src: false,
    };
    /// Both are.
    #[cfg(test)]
    pub const BOTH: Check = Check {
        dst: true,
        src: true,
    };
}

/// What the kernel said about one range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Vouch {
    /// Mapped with the access the copy needs: a plain copy is safe.
    Mapped,
    /// Some of it is not mapped at all.
    Unmapped,
    /// The kernel could not say (see the module's notes): `process_vm_readv` decides.
    Unsure,
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

/// Whether `madvise(MADV_POPULATE_READ)` works here: tried once on a page of our own.
fn populate_works() -> bool {
    *POPULATE.get_or_init(probe_populate)
}

fn probe_populate() -> bool {
    let page = page_size();
    // SAFETY: an anonymous private mapping of one page, owned here and unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    p != libc::MAP_FAILED && {
        // SAFETY: `p` is the live page mapped above; the advice changes no contents.
        let rc = unsafe { libc::madvise(p, page, MADV_POPULATE_READ) };
        // SAFETY: unmapping the page mapped above, which nothing else refers to.
        unsafe { libc::munmap(p, page) };
        rc == 0
    }
}

/// Ask the kernel whether `addr..addr+len` is mapped for reading (or writing): the pages
/// holding the range are populated as that access would, nothing is copied.
fn vouch(addr: usize, len: usize, write: bool) -> Vouch {
    let page = page_size();
    let start = addr & !(page - 1);
    let Some(end) = addr
        .checked_add(len)
        .and_then(|e| e.checked_add(page - 1))
        .map(|e| e & !(page - 1))
    else {
        return Vouch::Unsure;
    };
    let advice = if write {
        MADV_POPULATE_WRITE
    } else {
        MADV_POPULATE_READ
    };
    // SAFETY: population neither reads nor writes the range's contents (it faults pages in
    // as the access would, which the copy is about to do anyway); an unmapped range is an
    // error code, not a fault.
    let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice) };
    if rc == 0 {
        return Vouch::Mapped;
    }
    match io::Error::last_os_error().raw_os_error() {
        Some(libc::ENOMEM) => Vouch::Unmapped,
        _ => Vouch::Unsure,
    }
}

/// Caller memory that a batch of copies reads (`write: false`) or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallerRange {
    pub addr: usize,
    pub len: usize,
    pub write: bool,
}

/// Ask the kernel once for the caller memory of a whole batch of copies: `ranges` are sorted,
/// those that overlap or touch (reads and writes apart) merged, and each merged range vouched
/// for with one call (a batch of 256 blocks into 8 registered regions is 8 calls instead of
/// 256). True when every merged range is mapped with the access its copies need, so the copies
/// may skip their own check ([`Check::NONE`]). False (some memory unmapped, or a kernel that
/// cannot say): the copies check themselves, each getting its own answer. Nothing is ever
/// vouched for beyond the ranges given: gaps between them are not touched.
pub fn vouch_all(ranges: &mut [CallerRange]) -> bool {
    if !populate_works() {
        return false;
    }
    ranges.sort_unstable_by_key(|r| (r.write, r.addr));
    let mut run: Option<CallerRange> = None;
    for r in ranges.iter().filter(|r| r.len > 0) {
        match &mut run {
            Some(cur) if cur.write == r.write && r.addr <= cur.addr.saturating_add(cur.len) => {
                let end = cur
                    .addr
                    .saturating_add(cur.len)
                    .max(r.addr.saturating_add(r.len));
                cur.len = end - cur.addr;
            }
            _ => {
                if let Some(done) = run.replace(*r)
                    && vouch(done.addr, done.len, done.write) != Vouch::Mapped
                {
                    return false;
                }
            }
        }
    }
    run.is_none_or(|r| vouch(r.addr, r.len, r.write) == Vouch::Mapped)
}

fn efault() -> io::Error {
    io::Error::from_raw_os_error(libc::EFAULT)
}

/// Copy `len` bytes from `src` to `dst` (ranges that may overlap only if equal), with the
/// kernel vouching for the ranges that `check` names as caller memory: an unmapped or
/// unreadable source or unwritable destination is an `EFAULT` error, never a signal (see the
/// module's notes for the one race it cannot cover).
///
/// # Safety
/// No Rust reference may point into `dst..dst+len` during the call (the bytes are written
/// behind the compiler's back, like any copy into segment memory). The ranges `check` leaves
/// out must be valid for the copy; the validity of the others is *not* required: that is what
/// the kernel checks (unless it refused the calls, see the module's notes).
pub unsafe fn copy(dst: *mut u8, src: *const u8, len: usize, check: Check) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    if populate_works() {
        let d = if check.dst {
            vouch(dst as usize, len, true)
        } else {
            Vouch::Mapped
        };
        let s = if check.src && d == Vouch::Mapped {
            vouch(src as usize, len, false)
        } else {
            Vouch::Mapped
        };
        if d == Vouch::Unmapped || s == Vouch::Unmapped {
            return Err(efault());
        }
        if d == Vouch::Mapped && s == Vouch::Mapped {
            // SAFETY: the kernel has just vouched that the caller's ranges are mapped with
            // the access the copy needs; the others are valid by the caller's contract.
            unsafe { std::ptr::copy(src, dst, len) };
            return Ok(());
        }
    }
    if !UNAVAILABLE.load(Ordering::Relaxed) {
        let local = libc::iovec {
            iov_base: dst.cast(),
            iov_len: len,
        };
        let remote = libc::iovec {
            iov_base: src.cast_mut().cast(),
            iov_len: len,
        };
        // SAFETY: the iovecs are plain data; the kernel reads `remote` and writes `local` of
        // this process through its checked user copies (EFAULT on a bad address).
        let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
        if n >= 0 && n as usize == len {
            return Ok(());
        }
        let err = if n < 0 {
            io::Error::last_os_error()
        } else {
            efault()
        };
        match err.raw_os_error() {
            Some(libc::EPERM | libc::ENOSYS) => {
                UNAVAILABLE.store(true, Ordering::Relaxed);
                tracing::warn!(
                    error = %err,
                    "process_vm_readv is not allowed here: copies of registered caller memory \
                     that the kernel cannot vouch for are not checked (an unmapped buffer ends \
                     the process)"
                );
            }
            _ => return Err(err),
        }
    }
    // SAFETY: the fallback trusts the caller's registration, as before this check existed.
    unsafe { std::ptr::copy(src, dst, len) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An anonymous private mapping of `pages` pages with `prot`, owned by the test.
    fn map(pages: usize, prot: libc::c_int) -> *mut u8 {
        // SAFETY: a fresh anonymous mapping; the tests unmap what they map.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                pages * page_size(),
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p.cast()
    }

    fn unmap(p: *mut u8, pages: usize) {
        // SAFETY: unmapping what `map` mapped.
        unsafe { libc::munmap(p.cast(), pages * page_size()) };
    }

    #[test]
    fn mapped_memory_copies_and_unmapped_memory_is_efault() {
        let src: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let mut dst = vec![0u8; 10_000];
        // SAFETY: both are live vectors of 10,000 bytes.
        unsafe { copy(dst.as_mut_ptr(), src.as_ptr(), src.len(), Check::BOTH) }.unwrap();
        assert_eq!(dst, src);
        if UNAVAILABLE.load(Ordering::Relaxed) {
            return; // The kernel refused the call: the fallback cannot be tested safely.
        }
        // A page mapped with no access, then unmapped: both are faults, not signals.
        let page = map(1, libc::PROT_NONE);
        // SAFETY: the copies below are what is tested: the kernel checks the page.
        let from_none = unsafe { copy(dst.as_mut_ptr(), page, 100, Check::SRC) };
        let into_none = unsafe { copy(page, src.as_ptr(), 100, Check::DST) };
        unmap(page, 1);
        // SAFETY: as above.
        let from_gone = unsafe { copy(dst.as_mut_ptr(), page, 100, Check::SRC) };
        // SAFETY: as above.
        let into_gone = unsafe { copy(page, src.as_ptr(), 100, Check::BOTH) };
        for r in [from_none, into_none, from_gone, into_gone] {
            assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EFAULT));
        }
    }

    #[test]
    fn read_only_memory_is_no_destination_and_a_partly_unmapped_range_is_efault() {
        if UNAVAILABLE.load(Ordering::Relaxed) {
            return;
        }
        let page = page_size();
        let src = vec![7u8; 3 * page];
        let ro = map(1, libc::PROT_READ);
        // SAFETY: what is tested: the kernel refuses the write to a read-only page.
        let into_ro = unsafe { copy(ro, src.as_ptr(), 64, Check::DST) };
        assert_eq!(into_ro.unwrap_err().raw_os_error(), Some(libc::EFAULT));
        // Read-only memory is a fine source.
        let mut out = vec![1u8; 64];
        // SAFETY: `ro` is mapped readable; `out` is a live vector.
        unsafe { copy(out.as_mut_ptr(), ro, 64, Check::SRC) }.unwrap();
        assert_eq!(out, vec![0u8; 64]);
        unmap(ro, 1);
        // Three pages, the middle one unmapped: a copy across it fails and writes nothing
        // into the first page.
        let three = map(3, libc::PROT_READ | libc::PROT_WRITE);
        // SAFETY: unmapping the middle page of the mapping above.
        unsafe { libc::munmap(three.add(page).cast(), page) };
        // SAFETY: what is tested: the range crosses the hole.
        let across = unsafe { copy(three.add(page / 2), src.as_ptr(), 2 * page, Check::DST) };
        assert_eq!(across.unwrap_err().raw_os_error(), Some(libc::EFAULT));
        if populate_works() {
            // Checked before anything moved (the fallback copies up to the hole).
            // SAFETY: the first page is still mapped.
            assert!(
                unsafe { std::slice::from_raw_parts(three, page) }
                    .iter()
                    .all(|b| *b == 0)
            );
        }
        unmap(three, 1);
        // SAFETY: unmapping the last page.
        unsafe { libc::munmap(three.add(2 * page).cast(), page) };
    }

    #[test]
    fn ranges_that_start_and_end_inside_pages_are_copied_exactly() {
        let page = page_size();
        let src: Vec<u8> = (0..3 * page).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; 3 * page];
        // Unaligned start and end, across a page boundary: only those bytes change.
        let (at, len) = (page - 100, page + 300);
        // SAFETY: both ranges lie inside live vectors.
        unsafe {
            copy(
                dst.as_mut_ptr().add(at),
                src.as_ptr().add(at),
                len,
                Check::BOTH,
            )
        }
        .unwrap();
        assert!(dst[..at].iter().all(|b| *b == 0));
        assert_eq!(&dst[at..at + len], &src[at..at + len]);
        assert!(dst[at + len..].iter().all(|b| *b == 0));
    }

    #[test]
    fn a_batch_is_vouched_for_as_merged_ranges_and_gaps_between_them_are_not_asked() {
        if !populate_works() {
            return;
        }
        let page = page_size();
        let at = |p: *mut u8, i: usize, len: usize, write: bool| CallerRange {
            addr: p as usize + i * page,
            len,
            write,
        };
        // Four pages, the third unmapped: ranges on pages 0-1 and 3 (touching, overlapping,
        // out of order) are all mapped, and the hole between them is never asked about.
        let four = map(4, libc::PROT_READ | libc::PROT_WRITE);
        // SAFETY: unmapping the third page of the mapping above.
        unsafe { libc::munmap(four.add(2 * page).cast(), page) };
        let mut ok = [
            at(four, 3, page, true),
            at(four, 1, page, true),
            at(four, 0, page, true),
            at(four, 0, page / 2, false),
            at(four, 1, 10, true),
            at(four, 3, 0, true),
        ];
        assert!(vouch_all(&mut ok));
        // A range reaching into the hole fails the batch (each copy then checks itself).
        let mut into_hole = [at(four, 0, page, true), at(four, 1, page + 1, true)];
        assert!(!vouch_all(&mut into_hole));
        assert!(vouch_all(&mut []));
        unmap(four, 2);
        // SAFETY: unmapping the last page.
        unsafe { libc::munmap(four.add(3 * page).cast(), page) };
        // Read-only memory: a fine source, no destination.
        let ro = map(1, libc::PROT_READ);
        assert!(vouch_all(&mut [at(ro, 0, page, false)]));
        assert!(!vouch_all(&mut [at(ro, 0, 64, false), at(ro, 0, 64, true)]));
        unmap(ro, 1);
    }

    #[test]
    fn kernels_from_5_14_on_vouch_with_madvise() {
        // The fast path must not fall back to process_vm_readv unnoticed where it can run.
        let release =
            nix::sys::utsname::uname().map(|u| u.release().to_string_lossy().into_owned());
        let Ok(release) = release else { return };
        let mut parts = release
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|p| p.parse::<u32>().ok());
        let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
        if (major, minor) >= (5, 14) {
            assert!(
                populate_works(),
                "kernel {release}: MADV_POPULATE_READ refused"
            );
            let v = vec![0u8; 3 * page_size()];
            assert_eq!(
                vouch(v.as_ptr() as usize + 10, 2 * page_size(), false),
                Vouch::Mapped
            );
        }
    }
}
