//! The target's side of a connection with per-frame integrity (see `seal`): requests read
//! from verified records, WRITE payloads written into segment memory only once their record
//! verified, replies sealed. I/O boundary: the accepted TCP socket.

use std::io::{self, Read, Write};
use std::net::TcpStream;

use super::DataStream;
use crate::memory::Span;
use crate::seal::{OpenReader, SealWriter, SessionKeys};

/// An accepted connection whose every frame is sealed, both ways.
pub(super) struct SealedStream {
    reader: OpenReader<TcpStream>,
    writer: SealWriter<TcpStream>,
}

impl SealedStream {
    /// Seal `stream` under the connection's `keys` (target side).
    pub(super) fn new(stream: &TcpStream, keys: &SessionKeys) -> io::Result<Self> {
        let (seal, open) = keys.target();
        Ok(SealedStream {
            reader: OpenReader::new(stream.try_clone()?, open),
            writer: SealWriter::new(stream.try_clone()?, seal),
        })
    }
}

impl Read for SealedStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.reader.read(buf)
    }
}

impl Write for SealedStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.writer.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.writer.flush()
    }
}

fn give_up() -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::TimedOut,
        "timed out waiting for the peer",
    ))
}

impl DataStream for SealedStream {
    fn recv_into(&mut self, to: Span<'_>) -> io::Result<()> {
        self.reader.recv_spans(&[to], &mut give_up)
    }
    fn send_from(&mut self, from: Span<'_>) -> io::Result<()> {
        self.writer.send_spans(&[], &[from])
    }
    fn send_with_header(&mut self, header: &[u8], from: Span<'_>) -> io::Result<()> {
        self.writer.send_spans(header, &[from])
    }
    fn recv_into_spans(&mut self, to: &[Span<'_>]) -> io::Result<()> {
        self.reader.recv_spans(to, &mut give_up)
    }
    fn send_spans_with_header(&mut self, header: &[u8], from: &[Span<'_>]) -> io::Result<()> {
        self.writer.send_spans(header, from)
    }
}
