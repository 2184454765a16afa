//! Copies of caller memory that the kernel checks: a range a caller registered may have been
//! unmapped (or never mapped) since, and a plain `memcpy` from it ends the process with
//! SIGSEGV. [`copy`] moves bytes with `process_vm_readv` on this very process instead, which
//! copies through the kernel's fault-handling user copy and answers EFAULT for an address
//! that is not mapped with the access the copy needs. Where the kernel refuses the call itself
//! (a seccomp profile without it: EPERM or ENOSYS), the copy falls back to `memcpy` and says so
//! once. I/O boundary: the `process_vm_readv` system call.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::libc;

/// Set once `process_vm_readv` was refused by the kernel: later copies go straight to memcpy.
static UNAVAILABLE: AtomicBool = AtomicBool::new(false);

/// Copy `len` bytes from `src` to `dst` (ranges that may overlap only if equal), with the
/// kernel checking both: an unmapped or unreadable source or unwritable destination is an
/// `EFAULT` error, never a signal.
///
/// # Safety
/// No Rust reference may point into `dst..dst+len` during the call (the bytes are written
/// behind the compiler's back, like any copy into segment memory). Validity is *not* required:
/// that is what the kernel checks (unless it refused the call, see the module's notes).
pub unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) -> io::Result<()> {
    if len == 0 {
        return Ok(());
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
            io::Error::from_raw_os_error(libc::EFAULT)
        };
        match err.raw_os_error() {
            Some(libc::EPERM | libc::ENOSYS) => {
                UNAVAILABLE.store(true, Ordering::Relaxed);
                tracing::warn!(
                    error = %err,
                    "process_vm_readv is not allowed here: copies of registered caller memory \
                     are not checked by the kernel (an unmapped buffer ends the process)"
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

    #[test]
    fn mapped_memory_copies_and_unmapped_memory_is_efault() {
        let src: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let mut dst = vec![0u8; 10_000];
        // SAFETY: both are live vectors of 10,000 bytes.
        unsafe { copy(dst.as_mut_ptr(), src.as_ptr(), src.len()) }.unwrap();
        assert_eq!(dst, src);
        if UNAVAILABLE.load(Ordering::Relaxed) {
            return; // The kernel refused the call: the fallback cannot be tested safely.
        }
        // A page mapped with no access, then unmapped: both are faults, not signals.
        // SAFETY: an anonymous private mapping of one page, owned here.
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(page, libc::MAP_FAILED);
        // SAFETY: the copies below are what is tested: the kernel checks the page.
        let from_none = unsafe { copy(dst.as_mut_ptr(), page.cast(), 100) };
        let into_none = unsafe { copy(page.cast(), src.as_ptr(), 100) };
        // SAFETY: unmapping the page mapped above.
        unsafe { libc::munmap(page, 4096) };
        let from_gone = unsafe { copy(dst.as_mut_ptr(), page.cast(), 100) };
        for r in [from_none, into_none, from_gone] {
            assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EFAULT));
        }
    }
}
