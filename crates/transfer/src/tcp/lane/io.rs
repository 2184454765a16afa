//! The two halves of a lane's connection: plain (payloads moved straight between the socket
//! and segment memory), sealed (per-frame integrity, see `seal`: payloads copied through
//! verified records) or TLS (see `tls`: payloads copied through rustls). I/O boundary: the
//! lane's socket.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsFd;

use crate::memory::{self, Span};
use crate::seal::{OpenReader, SealWriter};
use crate::tls::{TlsReadHalf, TlsWriteHalf};
use crate::wire;

/// The sending half of a lane.
pub(super) enum LaneWriter {
    Plain(TcpStream),
    Sealed(Box<SealWriter<TcpStream>>),
    Tls(Box<TlsWriteHalf>),
}

impl LaneWriter {
    /// Write one frame: `head` and then the bytes of `spans`.
    pub(super) fn send(&mut self, head: &[u8], spans: &[Span<'_>]) -> io::Result<()> {
        match self {
            LaneWriter::Plain(s) if spans.is_empty() => s.write_all(head),
            LaneWriter::Plain(s) => {
                memory::send_spans(s.as_fd(), head, spans, &mut wire::fail_on_timeout)
            }
            LaneWriter::Sealed(w) => w.send_spans(head, spans),
            LaneWriter::Tls(w) => w.send(head, spans),
        }
    }
}

/// The receiving half of a lane.
pub(super) enum LaneReader {
    Plain(TcpStream),
    Sealed(Box<OpenReader<TcpStream>>),
    Tls(Box<TlsReadHalf>),
}

impl LaneReader {
    /// Receive exactly the bytes of `spans` into segment memory.
    pub(super) fn recv_spans(
        &mut self,
        spans: &[Span<'_>],
        on_timeout: &mut dyn FnMut() -> io::Result<()>,
    ) -> io::Result<()> {
        match self {
            LaneReader::Plain(s) => memory::recv_spans(s.as_fd(), spans, on_timeout),
            LaneReader::Sealed(r) => r.recv_spans(spans, on_timeout),
            LaneReader::Tls(r) => r.recv_spans(spans, on_timeout),
        }
    }
}

impl Read for LaneReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            LaneReader::Plain(s) => s.read(buf),
            LaneReader::Sealed(r) => r.read(buf),
            LaneReader::Tls(r) => r.read(buf),
        }
    }
}
