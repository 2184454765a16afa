//! The initiator's TLS connection of a lane, split between the lane's sender and receiver
//! threads: one `rustls::ClientConnection` behind a mutex that is held only to move bytes
//! into or out of rustls, never while blocking on the socket (the receiver reads ciphertext
//! without it; the sender encrypts into a buffer of its own under it and writes that buffer
//! without it, and only the sender ever writes to the socket, so records leave in order).
//! Also the copying paths between segment memory and any TLS stream. I/O boundary: the
//! lane's socket.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;

use parking_lot::Mutex;
use rustls::ClientConnection;

use super::ClientTls;
use crate::memory::Span;
use crate::wire::is_timeout;

/// Plaintext bytes handed to rustls at once, and the size of the copy buffers.
const CHUNK: usize = 256 * 1024;

/// A TLS client connection over `sock`, handshake done (within the socket's timeouts).
pub(crate) fn client_connect(
    tls: &ClientTls,
    addr: SocketAddr,
    sock: &mut TcpStream,
) -> io::Result<ClientConnection> {
    let mut conn = ClientConnection::new(tls.config.clone(), tls.name_for(addr))
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    while conn.is_handshaking() {
        conn.complete_io(sock)?;
    }
    while conn.wants_write() {
        conn.write_tls(sock)?;
    }
    // The sender bounds what it hands over (CHUNK); rustls need not refuse bytes.
    conn.set_buffer_limit(None);
    Ok(conn)
}

/// Split `conn` over `sock` into a lane's two halves.
pub(crate) fn split(
    conn: ClientConnection,
    sock: &TcpStream,
) -> io::Result<(TlsReadHalf, TlsWriteHalf)> {
    let shared = Arc::new(Mutex::new(conn));
    Ok((
        TlsReadHalf {
            conn: shared.clone(),
            sock: sock.try_clone()?,
            cipher: vec![0u8; 64 * 1024].into_boxed_slice(),
            pos: 0,
            end: 0,
            scratch: Vec::new(),
        },
        TlsWriteHalf {
            conn: shared,
            sock: sock.try_clone()?,
            out: Vec::new(),
            scratch: Vec::new(),
        },
    ))
}

fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// The receiving half: decrypted bytes, read through the shared connection.
pub(crate) struct TlsReadHalf {
    conn: Arc<Mutex<ClientConnection>>,
    sock: TcpStream,
    /// Ciphertext read from the socket: `cipher[pos..end]` not yet given to rustls.
    cipher: Box<[u8]>,
    pos: usize,
    end: usize,
    scratch: Vec<u8>,
}

impl Read for TlsReadHalf {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            {
                let mut conn = self.conn.lock();
                match conn.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
                if self.pos < self.end {
                    let n = conn.read_tls(&mut &self.cipher[self.pos..self.end])?;
                    self.pos += n;
                    conn.process_new_packets().map_err(tls_error)?;
                    continue;
                }
            }
            // Nothing buffered: wait for the socket without holding the connection.
            let n = self.sock.read(&mut self.cipher)?;
            if n == 0 {
                return Ok(0);
            }
            self.pos = 0;
            self.end = n;
        }
    }
}

impl TlsReadHalf {
    /// Receive exactly the bytes of `spans` into segment memory.
    pub(crate) fn recv_spans(
        &mut self,
        spans: &[Span<'_>],
        on_timeout: &mut dyn FnMut() -> io::Result<()>,
    ) -> io::Result<()> {
        let mut scratch = std::mem::take(&mut self.scratch);
        let r = recv_spans_copy(self, spans, on_timeout, &mut scratch);
        self.scratch = scratch;
        r
    }
}

/// The sending half: encrypts under the shared connection, writes without it.
pub(crate) struct TlsWriteHalf {
    conn: Arc<Mutex<ClientConnection>>,
    sock: TcpStream,
    /// Ciphertext to write, made under the lock.
    out: Vec<u8>,
    scratch: Vec<u8>,
}

impl Write for TlsWriteHalf {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let n = data.len().min(CHUNK);
        self.out.clear();
        {
            let mut conn = self.conn.lock();
            conn.writer().write_all(&data[..n])?;
            while conn.wants_write() {
                conn.write_tls(&mut self.out)?;
            }
        }
        let sent = self.sock.write_all(&self.out);
        self.out.clear();
        sent.map(|()| n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl TlsWriteHalf {
    /// Write one frame: `head` and then the bytes of `spans`.
    pub(crate) fn send(&mut self, head: &[u8], spans: &[Span<'_>]) -> io::Result<()> {
        let mut scratch = std::mem::take(&mut self.scratch);
        let r = send_spans_copy(self, head, spans, &mut scratch);
        self.scratch = scratch;
        r
    }
}

/// Write `head` and the bytes of `spans` to `w`, copied out of segment memory through
/// `scratch` in pieces of up to [`CHUNK`] bytes.
pub(crate) fn send_spans_copy<W: Write + ?Sized>(
    w: &mut W,
    head: &[u8],
    spans: &[Span<'_>],
    scratch: &mut Vec<u8>,
) -> io::Result<()> {
    scratch.clear();
    scratch.extend_from_slice(head);
    for span in spans {
        let mut done = 0usize;
        while done < span.len {
            let at = scratch.len();
            let n = (CHUNK.saturating_sub(at)).max(1).min(span.len - done);
            scratch.resize(at + n, 0);
            span.seg
                .read_at(span.offset + done as u64, &mut scratch[at..])
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            done += n;
            if scratch.len() >= CHUNK {
                w.write_all(scratch)?;
                scratch.clear();
            }
        }
    }
    if !scratch.is_empty() {
        w.write_all(scratch)?;
    }
    scratch.clear();
    Ok(())
}

/// Read exactly the bytes of `spans` from `r` into segment memory through `scratch`. On a
/// socket timeout `on_timeout` decides whether to keep waiting.
pub(crate) fn recv_spans_copy<R: Read + ?Sized>(
    r: &mut R,
    spans: &[Span<'_>],
    on_timeout: &mut dyn FnMut() -> io::Result<()>,
    scratch: &mut Vec<u8>,
) -> io::Result<()> {
    if scratch.len() < CHUNK {
        scratch.resize(CHUNK, 0);
    }
    for span in spans {
        let mut done = 0usize;
        while done < span.len {
            let want = (span.len - done).min(CHUNK);
            match r.read(&mut scratch[..want]) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "peer closed the connection mid-frame",
                    ));
                }
                Ok(n) => {
                    span.seg
                        .write_at(span.offset + done as u64, &scratch[..n])
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
                    done += n;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if is_timeout(&e) => on_timeout()?,
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}
