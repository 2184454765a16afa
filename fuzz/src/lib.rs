//! What the fuzz targets share: the record framing of inputs that carry several messages,
//! an in-memory byte stream, and the fixed keys the seed corpora are made with. The targets
//! themselves (`fuzz_targets/`) call the production decoders; nothing here decodes a kvpool
//! format. Seeds: `tests/fuzz_seeds.rs` in the root package writes and checks
//! `fuzz/corpus/<target>/`.

use std::io::{self, Cursor, Read, Write};

/// The pool key of the transfer engine and master targets (and their seeds).
pub const KEY: &[u8] = b"kvpool-fuzz-key-0123456789abcdef";

/// Splits an input into records `tag (u8) | length (u16 LE) | bytes`; the last record takes
/// what is left when the input ends early. The fuzz targets that replay a conversation
/// (several frames, several calls) read their inputs this way.
#[derive(Clone, Debug)]
pub struct Records<'a>(pub &'a [u8]);

impl<'a> Iterator for Records<'a> {
    type Item = (u8, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let (&tag, rest) = self.0.split_first()?;
        let (len, rest) = match rest {
            [a, b, rest @ ..] => (usize::from(u16::from_le_bytes([*a, *b])), rest),
            _ => (rest.len(), &[][..]),
        };
        let (body, rest) = rest.split_at(len.min(rest.len()));
        self.0 = rest;
        Some((tag, body))
    }
}

/// Appends one record in the framing [`Records`] reads (for building inputs by hand).
pub fn push_record(out: &mut Vec<u8>, tag: u8, body: &[u8]) {
    let len = u16::try_from(body.len()).unwrap_or(u16::MAX);
    out.push(tag);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&body[..usize::from(len)]);
}

/// A connection in memory: reads come from the input, writes are kept.
#[derive(Debug)]
pub struct Duplex<'a> {
    pub input: Cursor<&'a [u8]>,
    pub output: Vec<u8>,
}

impl<'a> Duplex<'a> {
    pub fn new(input: &'a [u8]) -> Self {
        Duplex {
            input: Cursor::new(input),
            output: Vec::new(),
        }
    }
}

impl Read for Duplex<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Duplex<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A little-endian u64 from the first 8 bytes of `b` (zero-padded), and the rest.
pub fn take_u64(b: &[u8]) -> (u64, &[u8]) {
    let n = b.len().min(8);
    let mut a = [0u8; 8];
    a[..n].copy_from_slice(&b[..n]);
    (u64::from_le_bytes(a), &b[n..])
}
