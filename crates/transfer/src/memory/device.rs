//! Device memory segments: bytes that live on an accelerator (a GPU's own memory) and that the
//! host can only reach through the device's copy engine. A [`DeviceMemory`] is the device side
//! (the CUDA implementation is `crate::cuda::CudaMemory`, feature `cuda`; tests use
//! [`FakeDevice`]); a segment made with `Segment::device` never lets its address be
//! dereferenced on the host: every byte moves through a [`Staging`] buffer (pinned host memory
//! for a GPU) with a queued copy the caller waits for.
//!
//! Payloads stream in chunks through two staging buffers so that the device copy of one chunk
//! overlaps the socket's move of the other ([`stream_out`], [`stream_in`]): the only host copy
//! of the bytes is the staging buffer the kernel sends from or receives into.
//! I/O boundary: none here (the device calls are the implementation's).

use std::io;
use std::sync::Arc;

use parking_lot::Mutex;

/// Bytes per staged chunk: large enough that a copy's fixed cost is small beside its transfer
/// time, small enough that two chunks per stream stay cheap to keep pinned.
pub const STAGING_CHUNK: usize = 4 << 20;

/// Errors of device memory access.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("device copy failed: {0}")]
    Copy(String),
    #[error("allocating {size} bytes of staging memory failed: {why}")]
    Staging { size: usize, why: String },
}

impl From<DeviceError> for io::Error {
    fn from(e: DeviceError) -> Self {
        io::Error::other(e)
    }
}

/// One staging buffer: host memory the device copies into and out of directly. A copy is
/// queued by `start_*` and done when `finish` returns; the bytes may be touched only between
/// a `finish` and the next `start_*`.
pub trait Staging: Send {
    /// Capacity in bytes.
    fn capacity(&self) -> usize;
    /// The first `len` bytes (`len <= capacity`), with no copy in flight.
    fn bytes(&mut self, len: usize) -> &mut [u8];
    /// Queue a copy of device bytes `offset..offset+len` into the buffer's first `len` bytes.
    fn start_download(&mut self, offset: u64, len: usize) -> Result<(), DeviceError>;
    /// Queue a copy of the buffer's first `len` bytes to the device at `offset`.
    fn start_upload(&mut self, offset: u64, len: usize) -> Result<(), DeviceError>;
    /// Wait until the queued copy (if any) has finished.
    fn finish(&mut self) -> Result<(), DeviceError>;
}

/// Memory of one device, as a segment's backing.
pub trait DeviceMemory: Send + Sync {
    /// The device's address of the first byte (what GPUDirect RDMA registers and what
    /// descriptors announce); never dereferenced on the host.
    fn device_addr(&self) -> u64;
    /// Size in bytes.
    fn len(&self) -> usize;
    /// Whether the memory has no bytes (segments refuse that).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The device's ordinal (CUDA device number).
    fn ordinal(&self) -> u32;
    /// The device's PCI address as sysfs names it (`0000:18:00.0`), when known.
    fn pci_bus_id(&self) -> Option<String>;
    /// A staging buffer of at least `min(len, STAGING_CHUNK)` bytes, from a pool where the
    /// implementation keeps one (pinned memory is costly to allocate).
    fn staging(&self, len: usize) -> Result<Box<dyn Staging>, DeviceError>;
    /// Give a staging buffer back to the pool (dropping it otherwise frees it).
    fn recycle(&self, staging: Box<dyn Staging>) {
        drop(staging);
    }
}

/// Two staging buffers of `dev`, returned to its pool when dropped.
struct Pair<'a> {
    dev: &'a dyn DeviceMemory,
    bufs: [Option<Box<dyn Staging>>; 2],
}

impl<'a> Pair<'a> {
    fn new(dev: &'a dyn DeviceMemory, len: usize) -> Result<Self, DeviceError> {
        let want = len.min(STAGING_CHUNK);
        let a = dev.staging(want)?;
        // One chunk needs one buffer.
        let b = if len > a.capacity() {
            Some(dev.staging(want)?)
        } else {
            None
        };
        Ok(Pair {
            dev,
            bufs: [Some(a), b],
        })
    }

    fn chunk(&self) -> usize {
        self.bufs[0].as_ref().map_or(1, |b| b.capacity().max(1))
    }

    fn get(&mut self, i: usize) -> &mut Box<dyn Staging> {
        let i = if self.bufs[1].is_some() { i % 2 } else { 0 };
        self.bufs[i]
            .as_mut()
            .expect("staging buffer present until drop")
    }
}

impl Drop for Pair<'_> {
    fn drop(&mut self) {
        for b in self.bufs.iter_mut().filter_map(Option::take) {
            // A copy may still be queued after an error: wait before the buffer is reused.
            let mut b = b;
            if b.finish().is_ok() {
                self.dev.recycle(b);
            }
        }
    }
}

/// The chunks of `offset..offset+len` in pieces of at most `chunk` bytes.
fn chunks(offset: u64, len: usize, chunk: usize) -> impl Iterator<Item = (u64, usize)> {
    (0..len)
        .step_by(chunk)
        .map(move |at| (offset + at as u64, chunk.min(len - at)))
}

/// Hand device bytes `offset..offset+len` to `sink` in order, chunk by chunk: the copy of the
/// next chunk runs on the device while `sink` consumes the current one.
pub fn stream_out(
    dev: &dyn DeviceMemory,
    offset: u64,
    len: usize,
    mut sink: impl FnMut(&[u8]) -> io::Result<()>,
) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    let mut pair = Pair::new(dev, len)?;
    let parts: Vec<(u64, usize)> = chunks(offset, len, pair.chunk()).collect();
    pair.get(0).start_download(parts[0].0, parts[0].1)?;
    for (i, &(_, n)) in parts.iter().enumerate() {
        pair.get(i).finish()?;
        if let Some(&(next_off, next_len)) = parts.get(i + 1) {
            pair.get(i + 1).start_download(next_off, next_len)?;
        }
        sink(pair.get(i).bytes(n))?;
    }
    Ok(())
}

/// Fill device bytes `offset..offset+len` from `source`, chunk by chunk: `source` fills one
/// staging buffer while the other's upload runs on the device. Every upload has finished when
/// this returns Ok.
pub fn stream_in(
    dev: &dyn DeviceMemory,
    offset: u64,
    len: usize,
    mut source: impl FnMut(&mut [u8]) -> io::Result<()>,
) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    let mut pair = Pair::new(dev, len)?;
    let parts: Vec<(u64, usize)> = chunks(offset, len, pair.chunk()).collect();
    for (i, &(off, n)) in parts.iter().enumerate() {
        // The buffer's previous upload (two chunks back) must be done before it is refilled.
        let buf = pair.get(i);
        buf.finish()?;
        source(buf.bytes(n))?;
        buf.start_upload(off, n)?;
    }
    for i in 0..2.min(parts.len()) {
        pair.get(i).finish()?;
    }
    Ok(())
}

/// A device made of host memory for tests: the "device" bytes sit behind a lock no host
/// address leads to, staging buffers are plain vectors, and every copy is counted, so tests
/// can check that a segment on it is only ever reached through staging.
pub struct FakeDevice {
    bytes: Mutex<Vec<u8>>,
    ordinal: u32,
    /// Staging buffers given back, reused as a real device's pinned pool is.
    pool: Mutex<Vec<Box<dyn Staging>>>,
    pub(crate) counts: Mutex<FakeCounts>,
}

/// What a [`FakeDevice`] was asked to do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FakeCounts {
    pub downloads: u64,
    pub uploads: u64,
    pub bytes_down: u64,
    pub bytes_up: u64,
    pub staging_allocated: u64,
}

impl FakeDevice {
    /// A zeroed fake device of `len` bytes, ordinal `ordinal`.
    pub fn new(len: usize, ordinal: u32) -> Arc<Self> {
        Arc::new(FakeDevice {
            bytes: Mutex::new(vec![0; len]),
            ordinal,
            pool: Mutex::new(Vec::new()),
            counts: Mutex::new(FakeCounts::default()),
        })
    }

    /// A copy of the device bytes `offset..offset+len` (test-side view; panics out of range).
    pub fn snapshot(&self, offset: usize, len: usize) -> Vec<u8> {
        self.bytes.lock()[offset..offset + len].to_vec()
    }

    /// Set device bytes at `offset` (test-side; panics out of range).
    pub fn poke(&self, offset: usize, data: &[u8]) {
        self.bytes.lock()[offset..offset + data.len()].copy_from_slice(data);
    }

    /// The copies asked of the device so far.
    pub fn counts(&self) -> FakeCounts {
        *self.counts.lock()
    }
}

struct FakeStaging {
    /// Weak: the device's pool holds its staging buffers.
    dev: std::sync::Weak<FakeDevice>,
    buf: Vec<u8>,
}

impl FakeStaging {
    fn device(&self) -> Result<Arc<FakeDevice>, DeviceError> {
        self.dev
            .upgrade()
            .ok_or_else(|| DeviceError::Copy("the fake device is gone".into()))
    }

    fn range(
        &self,
        dev: &FakeDevice,
        offset: u64,
        len: usize,
    ) -> Result<std::ops::Range<usize>, DeviceError> {
        let start = usize::try_from(offset).map_err(|_| DeviceError::Copy("offset".into()))?;
        let end = start
            .checked_add(len)
            .filter(|&e| e <= dev.bytes.lock().len() && len <= self.buf.len())
            .ok_or_else(|| DeviceError::Copy(format!("range {offset}+{len} out of bounds")))?;
        Ok(start..end)
    }
}

impl Staging for FakeStaging {
    fn capacity(&self) -> usize {
        self.buf.len()
    }
    fn bytes(&mut self, len: usize) -> &mut [u8] {
        &mut self.buf[..len]
    }
    fn start_download(&mut self, offset: u64, len: usize) -> Result<(), DeviceError> {
        let dev = self.device()?;
        let r = self.range(&dev, offset, len)?;
        self.buf[..len].copy_from_slice(&dev.bytes.lock()[r]);
        let mut c = dev.counts.lock();
        c.downloads += 1;
        c.bytes_down += len as u64;
        Ok(())
    }
    fn start_upload(&mut self, offset: u64, len: usize) -> Result<(), DeviceError> {
        let dev = self.device()?;
        let r = self.range(&dev, offset, len)?;
        dev.bytes.lock()[r].copy_from_slice(&self.buf[..len]);
        let mut c = dev.counts.lock();
        c.uploads += 1;
        c.bytes_up += len as u64;
        Ok(())
    }
    fn finish(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
}

/// The fake device's handle as a segment backing.
pub struct FakeDeviceMemory(pub Arc<FakeDevice>);

impl DeviceMemory for FakeDeviceMemory {
    fn device_addr(&self) -> u64 {
        // An address in the upper half that no host mapping uses: dereferencing it faults.
        0xffff_8000_0000_0000 | (u64::from(self.0.ordinal) << 40)
    }
    fn len(&self) -> usize {
        self.0.bytes.lock().len()
    }
    fn ordinal(&self) -> u32 {
        self.0.ordinal
    }
    fn pci_bus_id(&self) -> Option<String> {
        None
    }
    fn staging(&self, len: usize) -> Result<Box<dyn Staging>, DeviceError> {
        {
            let mut pool = self.0.pool.lock();
            if let Some(i) = pool.iter().position(|s| s.capacity() >= len) {
                return Ok(pool.swap_remove(i));
            }
        }
        self.0.counts.lock().staging_allocated += 1;
        Ok(Box::new(FakeStaging {
            dev: Arc::downgrade(&self.0),
            buf: vec![0; STAGING_CHUNK],
        }))
    }
    fn recycle(&self, staging: Box<dyn Staging>) {
        self.0.pool.lock().push(staging);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[test]
    fn streams_move_every_byte_in_order_across_chunks() {
        let len = 2 * STAGING_CHUNK + 12_345;
        let dev = FakeDevice::new(len + 100, 0);
        let mem = FakeDeviceMemory(dev.clone());
        let data = pattern(len);
        let mut fed = 0;
        stream_in(&mem, 100, len, |buf| {
            buf.copy_from_slice(&data[fed..fed + buf.len()]);
            fed += buf.len();
            Ok(())
        })
        .unwrap();
        assert_eq!(fed, len);
        assert_eq!(dev.snapshot(100, len), data);
        let mut out = Vec::new();
        stream_out(&mem, 100, len, |b| {
            out.extend_from_slice(b);
            Ok(())
        })
        .unwrap();
        assert_eq!(out, data);
        let c = dev.counts();
        assert_eq!((c.uploads, c.downloads), (3, 3));
        assert_eq!((c.bytes_up, c.bytes_down), (len as u64, len as u64));
        // Two staging buffers, reused by the second stream: never one per chunk.
        assert_eq!(c.staging_allocated, 2);
    }

    #[test]
    fn a_small_payload_uses_one_staging_buffer() {
        let dev = FakeDevice::new(4096, 1);
        let mem = FakeDeviceMemory(dev.clone());
        dev.poke(10, b"abc");
        let mut out = Vec::new();
        stream_out(&mem, 10, 3, |b| {
            out.extend_from_slice(b);
            Ok(())
        })
        .unwrap();
        assert_eq!(out, b"abc");
        assert_eq!(dev.counts().staging_allocated, 1);
    }

    #[test]
    fn a_failing_sink_or_source_stops_the_stream_with_its_error() {
        let dev = FakeDevice::new(3 * STAGING_CHUNK, 0);
        let mem = FakeDeviceMemory(dev.clone());
        let err = stream_out(&mem, 0, 3 * STAGING_CHUNK, |_| {
            Err(io::Error::new(io::ErrorKind::BrokenPipe, "peer gone"))
        })
        .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
        let err = stream_in(&mem, 0, 3 * STAGING_CHUNK, |_| {
            Err(io::Error::new(io::ErrorKind::UnexpectedEof, "short"))
        })
        .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        assert_eq!(
            dev.counts().uploads,
            0,
            "nothing half-received was uploaded"
        );
        // Out of the device's range: an error, not a panic.
        assert!(stream_out(&mem, 3 * STAGING_CHUNK as u64, 1, |_| Ok(())).is_err());
    }
}
