//! The target's side of a TLS connection (see `tls`): the rustls server handshake within the
//! connection's handshake deadline, then requests read and replies written through rustls,
//! payloads copied between segment memory and rustls. I/O boundary: the accepted TCP socket.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

use rustls::{ServerConfig, ServerConnection, StreamOwned};

use super::DataStream;
use crate::memory::Span;
use crate::tls::{recv_spans_copy, send_spans_copy};
use crate::wire;

/// An accepted connection served over TLS.
pub(super) struct TlsTarget {
    tls: StreamOwned<ServerConnection, TcpStream>,
    scratch: Vec<u8>,
}

impl TlsTarget {
    /// Run the TLS handshake on `sock` through `io` (the same socket, with the handshake
    /// deadline applied to every read and write).
    pub(super) fn accept<S: Read + Write>(
        config: &Arc<ServerConfig>,
        sock: TcpStream,
        io: &mut S,
    ) -> io::Result<Self> {
        let mut conn = ServerConnection::new(config.clone())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        while conn.is_handshaking() {
            conn.complete_io(io)?;
        }
        while conn.wants_write() {
            conn.write_tls(io)?;
        }
        Ok(TlsTarget {
            tls: StreamOwned::new(conn, sock),
            scratch: Vec::new(),
        })
    }

    /// The underlying socket.
    pub(super) fn socket(&self) -> &TcpStream {
        self.tls.get_ref()
    }
}

impl Read for TlsTarget {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.tls.read(buf)
    }
}

impl Write for TlsTarget {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tls.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.tls.flush()
    }
}

impl DataStream for TlsTarget {
    fn recv_into(&mut self, to: Span<'_>) -> io::Result<()> {
        self.recv_into_spans(&[to])
    }
    fn send_from(&mut self, from: Span<'_>) -> io::Result<()> {
        self.send_spans_with_header(&[], &[from])
    }
    fn send_with_header(&mut self, header: &[u8], from: Span<'_>) -> io::Result<()> {
        self.send_spans_with_header(header, &[from])
    }
    fn recv_into_spans(&mut self, to: &[Span<'_>]) -> io::Result<()> {
        let mut scratch = std::mem::take(&mut self.scratch);
        let r = recv_spans_copy(&mut self.tls, to, &mut wire::fail_on_timeout, &mut scratch);
        self.scratch = scratch;
        r
    }
    fn send_spans_with_header(&mut self, header: &[u8], from: &[Span<'_>]) -> io::Result<()> {
        let mut scratch = std::mem::take(&mut self.scratch);
        let r = send_spans_copy(&mut self.tls, header, from, &mut scratch);
        self.scratch = scratch;
        r?;
        self.tls.flush()
    }
}
