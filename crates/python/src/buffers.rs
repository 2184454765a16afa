//! Caller memory: objects with the buffer protocol (bytes, bytearray, memoryview, numpy arrays)
//! held for the length of a call, and the buffers registered with `register_buffer` that raw
//! pointers must fall inside. I/O boundary: the CPython buffer protocol, through the two C API
//! calls below, which CPython exports from 3.0 on (they joined the limited API only in 3.11,
//! so the abi3-py39 build declares them itself; `Py_buffer`'s layout has not changed since
//! 3.3).

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void};
use std::ptr::NonNull;
use std::sync::Arc;

use pyo3::ffi;
use pyo3::prelude::*;

use kvpool_transfer::{LocalSegment, Segment, TransferEngine};

use crate::errors::{Failure, Kind};

/// CPython's `Py_buffer`.
#[repr(C)]
struct RawBuffer {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

const PYBUF_SIMPLE: c_int = 0;
const PYBUF_WRITABLE: c_int = 0x0001;

unsafe extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

/// A contiguous view of a Python object's memory, held until dropped (the object cannot be
/// freed or resized meanwhile). Dropping takes the GIL to release the view.
pub struct Held {
    raw: Box<RawBuffer>,
}

// SAFETY: the view pins the exporter's memory until released; the pointer is only used for
// raw copies, and the release in `Drop` takes the GIL first.
unsafe impl Send for Held {}

impl Held {
    /// A view of `obj`; `writable` asks for memory the call may write. Fails with a
    /// `TypeError`-like `InvalidArgument` when `obj` has no contiguous buffer.
    pub fn new(obj: &Bound<'_, PyAny>, writable: bool) -> Result<Self, Failure> {
        let mut raw = Box::new(RawBuffer {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        });
        let flags = if writable {
            PYBUF_WRITABLE
        } else {
            PYBUF_SIMPLE
        };
        // SAFETY: the GIL is held (we have a Bound), `obj` is a live object and `raw` a
        // zeroed Py_buffer the call fills in.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *raw, flags) };
        if rc != 0 {
            let why = PyErr::take(obj.py()).map_or_else(String::new, |e| format!(": {e}"));
            let want = if writable { "a writable" } else { "a" };
            return Err(Failure::invalid(format!(
                "expected an object with {want} contiguous buffer (bytes, bytearray, memoryview, \
                 numpy array), got {}{why}",
                obj.get_type()
                    .name()
                    .map_or_else(|_| "?".to_owned(), |n| n.to_string())
            )));
        }
        Ok(Self { raw })
    }

    pub fn len(&self) -> usize {
        usize::try_from(self.raw.len).unwrap_or(0)
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.raw.buf.cast()
    }

    /// The bytes, read-only. Another Python thread could write the object while the GIL is
    /// released, as with any C extension that releases it; the call then stores whatever bytes
    /// were there.
    pub fn bytes(&self) -> &[u8] {
        if self.len() == 0 {
            return &[];
        }
        // SAFETY: the view pins `len` bytes at `buf` until `self` drops.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) }
    }

    /// The bytes, writable (only for views taken with `writable`).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        if self.len() == 0 || self.raw.readonly != 0 {
            return &mut [];
        }
        // SAFETY: a writable view pins `len` writable bytes at `buf` until `self` drops.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len()) }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        Python::attach(|_| {
            // SAFETY: the view was filled by a successful PyObject_GetBuffer and is released
            // once, with the GIL held.
            unsafe { PyBuffer_Release(&mut *self.raw) }
        });
    }
}

/// A caller buffer registered with the transfer engine.
struct Registered {
    len: u64,
    local: LocalSegment,
    /// The Python object's view when the buffer was registered as an object: it keeps the
    /// memory alive and in place until unregistered.
    _view: Option<Held>,
}

/// The buffers registered with `register_buffer`, by start address. Ranges never overlap.
#[derive(Default)]
pub struct Buffers {
    by_start: BTreeMap<usize, Registered>,
    next: u64,
}

/// Where a raw `(pointer, size)` falls: the registered buffer and the offset in it.
pub struct Span {
    pub local: LocalSegment,
    pub offset: u64,
    pub len: u64,
}

impl Buffers {
    /// Register `len` bytes at `ptr` with `engine`. The caller promises the memory stays valid
    /// until unregistered (Mooncake's contract for `register_buffer`).
    pub fn register(
        &mut self,
        engine: &TransferEngine,
        tag: &str,
        ptr: usize,
        len: u64,
        view: Option<Held>,
    ) -> Result<(), Failure> {
        let n = usize::try_from(len)
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| Failure::invalid(format!("buffer size {len} must be positive")))?;
        let start = NonNull::new(ptr as *mut u8)
            .ok_or_else(|| Failure::invalid("buffer address 0 is not valid"))?;
        let end = ptr
            .checked_add(n)
            .ok_or_else(|| Failure::invalid("buffer wraps around the address space"))?;
        if self.overlapping(ptr, end) {
            return Err(Failure::invalid(format!(
                "buffer {ptr:#x}+{len} overlaps a registered buffer"
            )));
        }
        let segment = match crate::device::segment(ptr, n)? {
            // A GPU's own memory: staged through the device's copies, never dereferenced.
            Some(on_gpu) => on_gpu,
            // SAFETY: Mooncake's contract: the caller keeps `ptr..ptr+len` valid until it
            // calls unregister_buffer (or closes the store); all accesses are raw copies.
            None => Arc::new(
                unsafe { Segment::from_raw_parts(start, n, None) }
                    .map_err(|e| Failure::invalid(format!("buffer {ptr:#x}+{len}: {e}")))?,
            ),
        };
        self.next += 1;
        let name = format!("{tag}/buffer-{}-{ptr:x}", self.next);
        let local = engine
            .register(&name, segment)
            .map_err(|e| Failure::new(Kind::Internal, format!("registering {name}: {e}")))?;
        self.by_start.insert(
            ptr,
            Registered {
                len,
                local,
                _view: view,
            },
        );
        Ok(())
    }

    fn overlapping(&self, start: usize, end: usize) -> bool {
        self.by_start
            .range(..end)
            .next_back()
            .is_some_and(|(s, r)| s.saturating_add(r.len as usize) > start)
    }

    /// Unregister the buffer starting at `ptr`; false when none starts there.
    pub fn unregister(&mut self, ptr: usize) -> bool {
        self.by_start.remove(&ptr).is_some()
    }

    /// Unregister every buffer.
    pub fn clear(&mut self) {
        self.by_start.clear();
    }

    pub fn count(&self) -> usize {
        self.by_start.len()
    }

    /// [`Self::span`] of each `(address, length)` range, in order.
    pub fn spans(&self, ranges: &[(usize, u64)]) -> Result<Vec<Span>, Failure> {
        ranges.iter().map(|(p, l)| self.span(*p, *l)).collect()
    }

    /// The registered buffer holding all of `ptr..ptr+len`.
    pub fn span(&self, ptr: usize, len: u64) -> Result<Span, Failure> {
        let (r, offset) = containing(&self.by_start, |r| r.len, ptr, len).ok_or_else(|| {
            Failure::new(
                Kind::NotRegistered,
                format!("memory {ptr:#x}+{len} is not inside a registered buffer"),
            )
        })?;
        Ok(Span {
            local: r.local.clone(),
            offset,
            len,
        })
    }
}

/// The region of `by_start` (regions by start address, each `len_of` bytes long) holding all
/// of `ptr..ptr+len`, and the offset of `ptr` in it; `None` when no one region does.
pub(crate) fn containing<V>(
    by_start: &BTreeMap<usize, V>,
    len_of: impl Fn(&V) -> u64,
    ptr: usize,
    len: u64,
) -> Option<(&V, u64)> {
    let (start, r) = by_start.range(..=ptr).next_back()?;
    let offset = (ptr - start) as u64;
    offset
        .checked_add(len)
        .is_some_and(|end| end <= len_of(r))
        .then_some((r, offset))
}
