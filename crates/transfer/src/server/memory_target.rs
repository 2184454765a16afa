//! The target's request loop over memory instead of a socket ([`MemoryTarget`]): a scripted
//! input stream, a captured output, one registered host segment. The fuzz targets
//! (`fuzz/fuzz_targets/transfer_server.rs`) and the property tests drive the real
//! [`serve_requests`] and handshake through it. I/O boundary: none (memory only).

use std::io::{self, Cursor, Read, Write};
use std::sync::Arc;
use std::time::Duration;

use super::{AdmissionLimits, DataStream, NotificationQueue, Registry, ServerCtx, serve_requests};
use crate::auth::AuthKey;
use crate::error::TransferError;
use crate::frame::FEATURES;
use crate::memory::{HostOptions, Segment, Span};
use crate::metrics::TransferMetrics;
use crate::wire::{self, WireError};

/// An in-memory connection: scripted input, captured output.
pub(crate) struct MemStream {
    pub(crate) input: Cursor<Vec<u8>>,
    pub(crate) output: Vec<u8>,
}

impl MemStream {
    pub(crate) fn new(input: Vec<u8>) -> Self {
        MemStream {
            input: Cursor::new(input),
            output: Vec::new(),
        }
    }
}

impl Read for MemStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for MemStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl DataStream for MemStream {
    fn recv_into(&mut self, to: Span<'_>) -> io::Result<()> {
        let mut tmp = vec![0u8; to.len];
        self.input.read_exact(&mut tmp)?;
        to.seg
            .write_at(to.offset, &tmp)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
    }
    fn send_from(&mut self, from: Span<'_>) -> io::Result<()> {
        let mut tmp = vec![0u8; from.len];
        from.seg
            .read_at(from.offset, &mut tmp)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        self.output.extend_from_slice(&tmp);
        Ok(())
    }
}

/// What one connection's bytes got from the target.
#[derive(Debug)]
pub struct Served {
    /// Every byte the target wrote back, in order.
    pub output: Vec<u8>,
    /// How the loop (or the handshake) ended: `Ok` when the input ran out between frames.
    pub result: Result<(), WireError>,
}

/// A transfer target serving one host segment named [`MemoryTarget::SEGMENT`] from memory:
/// each call plays one connection's bytes through the production handshake or request loop.
#[derive(derive_more::Debug)]
pub struct MemoryTarget {
    #[debug(skip)]
    ctx: ServerCtx,
    handle: u32,
    segment_len: u64,
}

impl MemoryTarget {
    /// Name of the registered segment.
    pub const SEGMENT: &'static str = "seg";

    /// A target with one zeroed host segment of `segment_len` bytes, accepting data payloads
    /// up to `max_slice`, holding `key`, serving vectored requests.
    pub fn new(segment_len: usize, max_slice: u64, key: AuthKey) -> Result<Self, TransferError> {
        let registry = Arc::new(Registry::default());
        let seg = Segment::host(segment_len, HostOptions::default())
            .map_err(|e| TransferError::Config(format!("memory target segment: {e}")))?;
        let seg = Arc::new(seg);
        let handle = registry
            .insert(Self::SEGMENT, seg)
            .ok_or_else(|| TransferError::Config("segment registered twice".into()))?;
        let metrics = TransferMetrics::unregistered()
            .map_err(|e| TransferError::Config(format!("transfer metrics: {e}")))?;
        let ctx = ServerCtx {
            registry,
            key,
            max_slice,
            timeout: Duration::from_secs(1),
            handshake_timeout: Duration::from_secs(1),
            limits: AdmissionLimits {
                max_connections: 1,
                max_per_source: 1,
                max_handshakes: 1,
            },
            notifications: Arc::new(NotificationQueue::new(4)),
            metrics,
            rdma: None,
            integrity: crate::Integrity::Allow,
            tls: crate::TlsMode::Off,
            tls_server: None,
            features: FEATURES,
        };
        Ok(MemoryTarget {
            ctx,
            handle,
            segment_len: segment_len as u64,
        })
    }

    /// The segment's handle (what OPEN_OK answers).
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// The segment's length in bytes.
    pub fn segment_len(&self) -> u64 {
        self.segment_len
    }

    /// This target's instance id (OPEN_OK's `status`).
    pub fn instance(&self) -> u32 {
        self.ctx.registry.instance
    }

    /// Serve `input` as the request frames of an authenticated connection; a socket timeout
    /// cannot happen in memory, so the loop ends when the input does (or at a bad frame).
    pub fn serve_requests(&self, input: Vec<u8>) -> Served {
        let mut s = MemStream::new(input);
        let result = serve_requests(&mut s, &self.ctx, "memory", &mut |_| {
            Err(io::Error::other("no idle waits in memory"))
        });
        Served {
            output: s.output,
            result,
        }
    }

    /// Run the target side of the handshake on `input` (this target's nonce is random).
    pub fn server_handshake(&self, input: Vec<u8>) -> Served {
        let mut s = MemStream::new(input);
        let result = wire::server_handshake(&mut s, &self.ctx.key);
        Served {
            output: s.output,
            result,
        }
    }
}
