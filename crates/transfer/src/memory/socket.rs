//! Moving payloads between sockets and segment memory: [`Span`] (a range of a segment) with
//! its `recv`/`send` straight into and out of the segment, and the vectored forms
//! ([`send_spans`], [`recv_spans`]) that move several ranges with one `sendmsg`/`recvmsg`.
//! I/O boundary: the sockets given.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use nix::libc;

use super::Segment;
use super::device::{self, DeviceMemory};

/// What a blocking socket call that hit its `SO_RCVTIMEO`/`SO_SNDTIMEO` should do next.
pub(crate) type OnTimeout<'a> = &'a mut dyn FnMut() -> io::Result<()>;

/// Run a raw `recv`/`send` until `len` bytes have moved. `call(done)` moves bytes from `done`
/// on and returns how many it moved; an interrupted call is repeated, and on a socket timeout
/// `on_timeout` decides whether to keep waiting (Ok) or give up (Err).
fn move_all(
    len: usize,
    on_timeout: OnTimeout<'_>,
    mut call: impl FnMut(usize) -> io::Result<usize>,
) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        match call(done) {
            Ok(n) => done += n,
            Err(err) => match err.kind() {
                io::ErrorKind::Interrupted => {}
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => on_timeout()?,
                _ => return Err(err),
            },
        }
    }
    Ok(())
}

/// The byte count of a `recv`/`send` return value, or the OS error it signals.
fn syscall_len(n: isize) -> io::Result<usize> {
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// `send(2)` up to `len` bytes at `ptr` to `fd` with `flags`.
///
/// # Safety
/// `ptr..ptr+len` must be readable for the whole call.
unsafe fn send_raw(
    fd: BorrowedFd<'_>,
    ptr: *const u8,
    len: usize,
    flags: libc::c_int,
) -> io::Result<usize> {
    // SAFETY: the caller guarantees that ptr..ptr+len is readable; the kernel only reads it.
    syscall_len(unsafe { libc::send(fd.as_raw_fd(), ptr.cast(), len, flags) })
}

/// Send all of `bytes` (a live host slice) to `fd`.
fn send_slice(fd: BorrowedFd<'_>, bytes: &[u8], on_timeout: OnTimeout<'_>) -> io::Result<()> {
    move_all(bytes.len(), on_timeout, |done| {
        let rest = &bytes[done..];
        // SAFETY: `rest` is a live Rust slice.
        unsafe { send_raw(fd, rest.as_ptr(), rest.len(), libc::MSG_NOSIGNAL) }
    })
}

/// Receive exactly `len` bytes from `fd` into `base..base+len`.
///
/// # Safety
/// `base..base+len` must be writable for the whole call and not referenced by any Rust
/// reference but the caller's exclusive one (if any).
unsafe fn recv_raw_all(
    fd: BorrowedFd<'_>,
    base: *mut u8,
    len: usize,
    on_timeout: OnTimeout<'_>,
) -> io::Result<()> {
    move_all(len, on_timeout, |done| {
        // SAFETY: base+done..base+len is writable (the caller's contract); the kernel writes
        // at most `len - done` bytes there.
        let n = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                base.add(done).cast(),
                len - done,
                libc::MSG_WAITALL,
            )
        };
        match syscall_len(n)? {
            0 => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed the connection mid-payload",
            )),
            n => Ok(n),
        }
    })
}

/// Receive exactly `bytes.len()` bytes from `fd` into `bytes` (a live host slice).
fn recv_slice(fd: BorrowedFd<'_>, bytes: &mut [u8], on_timeout: OnTimeout<'_>) -> io::Result<()> {
    // SAFETY: `bytes` is borrowed mutably for the whole call.
    unsafe { recv_raw_all(fd, bytes.as_mut_ptr(), bytes.len(), on_timeout) }
}

/// A byte range of a segment, `seg[offset..offset + len]`: where a payload moving between a
/// socket and segment memory is received into or sent from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span<'a> {
    pub(crate) seg: &'a Segment,
    pub(crate) offset: u64,
    pub(crate) len: usize,
}

impl<'a> Span<'a> {
    pub(crate) fn new(seg: &'a Segment, offset: u64, len: usize) -> Self {
        Span { seg, offset, len }
    }

    /// The device memory of a span of a device segment, after checking the range.
    fn device(self) -> io::Result<Option<&'a dyn DeviceMemory>> {
        match self.seg.device_memory_backing() {
            Some(dev) => {
                self.seg
                    .check_range(self.offset, self.len as u64)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
                Ok(Some(dev))
            }
            None => Ok(None),
        }
    }

    /// Raw pointer to the start of the range, after checking that it lies inside the segment.
    fn start(self) -> io::Result<*mut u8> {
        self.seg
            .ptr_at(self.offset, self.len)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
    }

    /// Receive exactly the range's bytes from `fd` straight into it. On a socket timeout
    /// `on_timeout` decides whether to keep waiting (Ok) or give up (Err).
    pub(crate) fn recv(self, fd: BorrowedFd<'_>, on_timeout: OnTimeout<'_>) -> io::Result<()> {
        if let Some(dev) = self.device()? {
            // Into staging, then up to the device while the next chunk arrives.
            return device::stream_in(dev, self.offset, self.len, |buf| {
                recv_slice(fd, buf, &mut *on_timeout)
            });
        }
        let (base, len) = (self.start()?, self.len);
        // SAFETY: base..base+len is inside the segment (checked by `start`); no Rust reference
        // to segment bytes exists (the module's memory model).
        unsafe { recv_raw_all(fd, base, len, on_timeout) }
    }

    /// Send exactly the range's bytes to `fd`.
    pub(crate) fn send(self, fd: BorrowedFd<'_>, on_timeout: OnTimeout<'_>) -> io::Result<()> {
        if let Some(dev) = self.device()? {
            // Down to staging, sent while the next chunk comes down.
            return device::stream_out(dev, self.offset, self.len, |buf| {
                send_slice(fd, buf, &mut *on_timeout)
            });
        }
        let (base, len) = (self.start()?, self.len);
        move_all(len, on_timeout, |done| {
            // SAFETY: base+done..base+len is inside the segment (checked above).
            unsafe { send_raw(fd, base.add(done), len - done, libc::MSG_NOSIGNAL) }
        })
    }

    /// Send `prefix` (a frame header) and then the range's bytes to `fd`. The prefix goes with
    /// MSG_MORE so that the kernel coalesces it with the payload instead of pushing a tiny
    /// packet (and waking the receiver) on its own.
    pub(crate) fn send_prefixed(
        self,
        fd: BorrowedFd<'_>,
        prefix: &[u8],
        on_timeout: OnTimeout<'_>,
    ) -> io::Result<()> {
        if self.device()?.is_none() {
            self.start()?;
        }
        let more = if self.len > 0 { libc::MSG_MORE } else { 0 };
        move_all(prefix.len(), on_timeout, |done| {
            let rest = &prefix[done..];
            // SAFETY: `rest` is a live Rust slice.
            unsafe { send_raw(fd, rest.as_ptr(), rest.len(), libc::MSG_NOSIGNAL | more) }
        })?;
        self.send(fd, on_timeout)
    }
}

/// Which way a vectored socket call moves bytes.
#[derive(Clone, Copy)]
enum Direction {
    Send,
    Recv,
}

/// Move all bytes of `pieces` (pointer, length) through `fd` with `sendmsg`/`recvmsg`, as few
/// calls as the kernel allows, resuming after partial moves.
///
/// # Safety
/// Every piece must be valid for the whole call: readable when sending, writable (and not
/// referenced by any Rust reference) when receiving.
unsafe fn move_vectored(
    fd: BorrowedFd<'_>,
    pieces: &[(*mut u8, usize)],
    dir: Direction,
    on_timeout: OnTimeout<'_>,
) -> io::Result<()> {
    const IOV_MAX: usize = 1024;
    let mut idx = 0usize;
    let mut skip = 0usize;
    let mut iov: Vec<libc::iovec> = Vec::with_capacity(pieces.len().min(IOV_MAX));
    loop {
        while idx < pieces.len() && pieces[idx].1 == skip {
            idx += 1;
            skip = 0;
        }
        if idx == pieces.len() {
            return Ok(());
        }
        iov.clear();
        for (i, &(ptr, len)) in pieces[idx..].iter().take(IOV_MAX).enumerate() {
            let (base, len) = if i == 0 {
                // SAFETY: skip < len of this piece (the loop above moved past finished ones).
                (unsafe { ptr.add(skip) }, len - skip)
            } else {
                (ptr, len)
            };
            iov.push(libc::iovec {
                iov_base: base.cast(),
                iov_len: len,
            });
        }
        // SAFETY: msghdr is plain data; zeroed is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len() as _;
        // SAFETY: the iovecs point into the caller's pieces, valid for the call (contract).
        let n = unsafe {
            match dir {
                Direction::Send => libc::sendmsg(fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL),
                Direction::Recv => libc::recvmsg(fd.as_raw_fd(), &mut msg, libc::MSG_WAITALL),
            }
        };
        let mut n = match syscall_len(n) {
            Ok(0) if matches!(dir, Direction::Recv) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "peer closed the connection mid-payload",
                ));
            }
            Ok(n) => n,
            Err(err) => match err.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                    on_timeout()?;
                    continue;
                }
                _ => return Err(err),
            },
        };
        while n > 0 && idx < pieces.len() {
            let rest = pieces[idx].1 - skip;
            if n >= rest {
                n -= rest;
                idx += 1;
                skip = 0;
            } else {
                skip += n;
                n = 0;
            }
        }
    }
}

/// Send `prefix` (a frame header, a range table) and then the bytes of `spans`, in order,
/// with vectored `sendmsg` calls: one call for the whole frame when the socket has room.
pub(crate) fn send_spans(
    fd: BorrowedFd<'_>,
    prefix: &[u8],
    spans: &[Span<'_>],
    on_timeout: OnTimeout<'_>,
) -> io::Result<()> {
    if spans
        .iter()
        .any(|s| s.seg.device_memory_backing().is_some())
    {
        // Device ranges stage chunk by chunk; the frame goes out piece by piece.
        send_slice(fd, prefix, &mut *on_timeout)?;
        return spans.iter().try_for_each(|s| s.send(fd, &mut *on_timeout));
    }
    let mut pieces = Vec::with_capacity(spans.len() + 1);
    pieces.push((prefix.as_ptr().cast_mut(), prefix.len()));
    for s in spans {
        pieces.push((s.start()?, s.len));
    }
    // SAFETY: `prefix` is a live slice and every span lies inside its segment (checked by
    // `start`); sending only reads them.
    unsafe { move_vectored(fd, &pieces, Direction::Send, on_timeout) }
}

/// Receive exactly the bytes of `spans`, in order, straight into them with vectored
/// `recvmsg` calls.
pub(crate) fn recv_spans(
    fd: BorrowedFd<'_>,
    spans: &[Span<'_>],
    on_timeout: OnTimeout<'_>,
) -> io::Result<()> {
    if spans
        .iter()
        .any(|s| s.seg.device_memory_backing().is_some())
    {
        return spans.iter().try_for_each(|s| s.recv(fd, &mut *on_timeout));
    }
    let mut pieces = Vec::with_capacity(spans.len());
    for s in spans {
        pieces.push((s.start()?, s.len));
    }
    // SAFETY: every span lies inside its segment (checked by `start`); segment memory is only
    // ever accessed through raw pointers, so the kernel writing there aliases no reference.
    unsafe { move_vectored(fd, &pieces, Direction::Recv, on_timeout) }
}
