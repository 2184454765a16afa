//! The initiator's reading of replies on a direct connection ([`ReplyReader`]), over any
//! readable descriptor rather than only the TCP socket `inline` dials: the fuzz target
//! `transfer_client` feeds it hostile replies through a socket pair. The reading itself is
//! `inline`'s (one reply per request, in order; READ payloads straight into local memory).
//! I/O boundary: the descriptor passed in.

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsFd;
use std::time::Duration;

use super::inline::{InlinePart, InlineSlice, read_reply};
use crate::error::{Failure, TransferError};
use crate::memory::{HostOptions, Segment};

/// One request whose reply is expected: a READ or WRITE over one or more ranges (several make
/// a READV or WRITEV), each `len` bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpectedReply {
    pub write: bool,
    pub lens: Vec<u64>,
}

/// What one reply meant: `Ok(Ok)` the request succeeded, `Ok(Err)` it failed alone (the
/// target's ERROR), `Err` the connection cannot be used any more.
pub type ReplyOutcome = Result<Result<(), Failure>, Failure>;

/// Reads the replies of a direct connection into a local host segment.
pub struct ReplyReader {
    local: Segment,
    max_slice: u64,
}

impl std::fmt::Debug for ReplyReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplyReader")
            .field("local_len", &self.local.len())
            .field("max_slice", &self.max_slice)
            .finish()
    }
}

impl ReplyReader {
    /// A reader receiving READ payloads into a local segment of `local_len` bytes and
    /// accepting payloads up to `max_slice`.
    pub fn new(local_len: usize, max_slice: u64) -> Result<Self, TransferError> {
        let local = Segment::host(local_len, HostOptions::default())
            .map_err(|e| TransferError::Config(format!("reply reader segment: {e}")))?;
        Ok(ReplyReader { local, max_slice })
    }

    /// Read the replies to `expected` (request ids 1, 2, ... in order) from `stream`, as an
    /// inline transfer does, until every request has its outcome or the connection fails
    /// (the last outcome is then that `Err`). Ranges lie back to back in the local segment;
    /// requests beyond it are not read.
    pub fn read<S: io::Read + AsFd>(
        &self,
        stream: &mut S,
        expected: &[ExpectedReply],
    ) -> Vec<ReplyOutcome> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let mut out = Vec::with_capacity(expected.len());
        let mut at = 0u64;
        for (i, e) in expected.iter().enumerate() {
            let Some(slice) = self.slice(e, &mut at) else {
                break;
            };
            let outcome = read_reply(
                stream,
                addr,
                (self.max_slice, Duration::ZERO),
                &slice,
                i as u64 + 1,
            );
            let failed = outcome.is_err();
            out.push(outcome);
            if failed {
                break;
            }
        }
        out
    }

    /// The slice of `e` with its ranges placed from `at` in the local segment, if they fit.
    fn slice(&self, e: &ExpectedReply, at: &mut u64) -> Option<InlineSlice<'_>> {
        let (&first, rest) = e.lens.split_first()?;
        let mut place = |len: u64| -> Option<u64> {
            let start = *at;
            let end = start.checked_add(len)?;
            if end > self.local.len() as u64 {
                return None;
            }
            *at = end;
            Some(start)
        };
        let local_offset = place(first)?;
        let mut more = Vec::with_capacity(rest.len());
        for &len in rest {
            more.push(InlinePart {
                local: &self.local,
                local_offset: place(len)?,
                remote_offset: 0,
                len,
            });
        }
        Some(InlineSlice {
            write: e.write,
            local: &self.local,
            local_offset,
            handle: 1,
            instance: 0,
            remote_offset: 0,
            len: first,
            more,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{Header, Opcode};
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    fn reply(op: Opcode, id: u64, status: u32, payload: &[u8]) -> Vec<u8> {
        let mut h = Header::new(op, id);
        h.status = status;
        h.length = payload.len() as u64;
        let mut v = h.encode().to_vec();
        v.extend_from_slice(payload);
        v
    }

    fn read(expected: &[ExpectedReply], replies: &[u8]) -> (ReplyReader, Vec<ReplyOutcome>) {
        let reader = ReplyReader::new(4096, 1 << 20).unwrap();
        let (mut target, mut initiator) = UnixStream::pair().unwrap();
        target.write_all(replies).unwrap();
        drop(target);
        let out = reader.read(&mut initiator, expected);
        (reader, out)
    }

    #[test]
    fn replies_settle_requests_in_order_and_read_data_lands_in_local_memory() {
        let expected = [
            ExpectedReply {
                write: true,
                lens: vec![8],
            },
            ExpectedReply {
                write: false,
                lens: vec![4, 4],
            },
            ExpectedReply {
                write: false,
                lens: vec![16],
            },
        ];
        let mut replies = reply(Opcode::WriteAck, 1, 0, &[]);
        replies.extend(reply(Opcode::ReadData, 2, 0, b"abcdefgh"));
        replies.extend(reply(Opcode::Error, 3, 4, b"out of bounds"));
        let (reader, out) = read(&expected, &replies);
        assert_eq!(out.len(), 3);
        assert!(matches!(out[0], Ok(Ok(()))));
        assert!(matches!(out[1], Ok(Ok(()))));
        assert!(matches!(&out[2], Ok(Err(f)) if f.category == "out_of_bounds"));
        // The READ's two ranges lie after the WRITE's 8 bytes.
        let mut got = [0u8; 8];
        reader.local.read_at(8, &mut got).unwrap();
        assert_eq!(&got, b"abcdefgh");
    }

    #[test]
    fn a_bad_reply_gives_up_the_connection_at_that_request() {
        let expected = vec![
            ExpectedReply {
                write: false,
                lens: vec![8],
            };
            3
        ];
        // A READ_DATA of the wrong length, then nothing more is read.
        let mut replies = reply(Opcode::ReadData, 1, 0, &[0; 8]);
        replies.extend(reply(Opcode::ReadData, 2, 0, &[0; 4]));
        let (_, out) = read(&expected, &replies);
        assert_eq!(out.len(), 2);
        assert!(matches!(out[0], Ok(Ok(()))));
        assert!(matches!(&out[1], Err(f) if f.category == "protocol"));
        // The peer closing before a reply gives up the connection too.
        let (_, out) = read(&expected[..1], &[]);
        assert!(matches!(&out[..], [Err(f)] if f.category == "peer_closed"));
    }
}
