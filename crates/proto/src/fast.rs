//! The master's fast lane: the same unary calls as the gRPC API (same protobuf messages, same
//! credentials, same handlers), framed plainly on a TCP connection for clients that make one
//! call at a time and wait for it. HTTP/2 costs such a caller more than the master's work:
//! stream setup, flow control and the server's per-stream task. The lane shares the gRPC
//! port: a connection that starts with [`PREFACE`] is a fast-lane connection, anything else
//! is handed to the gRPC server. Pure: framing only, no I/O.
//!
//! ```text
//! connection:  client -> PREFACE (8 bytes: "KVMP", version, 0, 0, 0)
//!              server -> PREFACE (the same 8 bytes: the server speaks this version)
//! request:     u32 len | u8 method | u8 flags | u16 auth_len | credential (auth_len)
//!              | [flags & 1: u16 n | n x u64 lease ids] | protobuf
//! reply:       u32 len | u8 code | u8 0 | u16 hint_len | leader hint (hint_len)
//!              | protobuf (code 0) or UTF-8 message (any other gRPC status code)
//! ```
//! `len` counts the bytes after itself; integers are little endian. Calls on a connection are
//! answered in order, one at a time. A request may carry read leases to release before the
//! call runs (flag 1): a client with one call in flight releases the leases of its last read
//! with its next call instead of making a call of its own for them. The credential is the gRPC API's (see [`crate::auth`]),
//! checked the same way, replay cache included, and in addition bound to the request's tail
//! (lease ids and body, [`request_tail`]): the master checks the credential before it reads the
//! tail, then the tail against the credential's digest.

/// First bytes of a fast-lane connection.
pub const MAGIC: [u8; 4] = *b"KVMP";
/// Version spoken by this build.
pub const VERSION: u8 = 1;
/// What the client sends first and the server answers with.
pub const PREFACE: [u8; 8] = [b'K', b'V', b'M', b'P', VERSION, 0, 0, 0];
/// Largest frame either side accepts (the gRPC API's message limit plus the frame's head).
pub const MAX_FRAME: u32 = (64 << 20) + 64 * 1024;
/// Bytes of a frame's head after `len`: method or code, flags (reserved in replies), and the
/// u16 length.
const HEAD: usize = 4;
/// Request flag: lease ids to release come before the body.
const FLAG_RELEASES: u8 = 1;
/// Leases one request may carry at most (the master's batch limit).
pub const MAX_RELEASES: usize = crate::master::MAX_BATCH;

/// The calls the fast lane carries (the hot ones of reads and writes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::FromRepr, strum::IntoStaticStr)]
#[repr(u8)]
#[strum(serialize_all = "snake_case")]
pub enum Method {
    Get = 1,
    Exists = 2,
    PutStart = 3,
    PutEnd = 4,
    PutRevoke = 5,
    ReleaseLeases = 6,
    Remove = 7,
    LongestPrefix = 8,
}

impl Method {
    /// The method of a gRPC method name (`put_start`), if the fast lane carries it.
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "get" => Method::Get,
            "exists" => Method::Exists,
            "put_start" => Method::PutStart,
            "put_end" => Method::PutEnd,
            "put_revoke" => Method::PutRevoke,
            "release_leases" => Method::ReleaseLeases,
            "remove" => Method::Remove,
            "longest_prefix" => Method::LongestPrefix,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        self.into()
    }

    /// The gRPC method name (`PutStart`): what its credential is made for.
    pub fn grpc_name(self) -> &'static str {
        match self {
            Method::Get => "Get",
            Method::Exists => "Exists",
            Method::PutStart => "PutStart",
            Method::PutEnd => "PutEnd",
            Method::PutRevoke => "PutRevoke",
            Method::ReleaseLeases => "ReleaseLeases",
            Method::Remove => "Remove",
            Method::LongestPrefix => "LongestPrefix",
        }
    }
}

/// Why a frame was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {0} bytes exceeds the limit of {MAX_FRAME}")]
    TooLarge(u32),
    #[error("frame of {0} bytes is shorter than its head")]
    Short(usize),
    #[error("reserved byte is {0}, not 0")]
    Reserved(u8),
    #[error("unknown request flags {0:#04x}")]
    Flags(u8),
    #[error("{0} lease ids exceed the limit of {MAX_RELEASES}")]
    TooManyReleases(usize),
    #[error("the head says {want} bytes of {what} but the frame has {have}")]
    Truncated {
        what: &'static str,
        want: usize,
        have: usize,
    },
    #[error("unknown method {0}")]
    UnknownMethod(u8),
    #[error("the credential is not UTF-8")]
    Credential,
    #[error("preface {0:02x?} is not a fast-lane preface of version {VERSION}")]
    Preface([u8; 8]),
}

/// Check a frame's `len` field before reading the frame.
pub fn check_len(len: u32) -> Result<usize, FrameError> {
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    Ok(len as usize)
}

/// Check the preface the other side sent.
pub fn check_preface(p: [u8; 8]) -> Result<(), FrameError> {
    if p == PREFACE {
        Ok(())
    } else {
        Err(FrameError::Preface(p))
    }
}

/// Append a frame to `out`: `len`, tag, flags, the u16-length `head_bytes`, `extra`, `body`.
fn frame(out: &mut Vec<u8>, tag: u8, flags: u8, head_bytes: &[u8], extra: &[u8], body: &[u8]) {
    let head_len = u16::try_from(head_bytes.len()).unwrap_or(u16::MAX);
    let head_bytes = &head_bytes[..head_len as usize];
    let len = HEAD + head_bytes.len() + extra.len() + body.len();
    out.reserve(4 + len);
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes());
    out.push(tag);
    out.push(flags);
    out.extend_from_slice(&head_len.to_le_bytes());
    out.extend_from_slice(head_bytes);
    out.extend_from_slice(extra);
    out.extend_from_slice(body);
}

/// A frame's parts after its `len`: tag, flags, the u16-length string, the rest.
type Parts<'a> = (u8, u8, &'a [u8], &'a [u8]);

/// Split a frame (without its `len`) into its [`Parts`].
fn split(frame: &[u8]) -> Result<Parts<'_>, FrameError> {
    let [tag, flags, a, b, rest @ ..] = frame else {
        return Err(FrameError::Short(frame.len()));
    };
    let n = u16::from_le_bytes([*a, *b]) as usize;
    if rest.len() < n {
        return Err(FrameError::Truncated {
            what: "head string",
            want: n,
            have: rest.len(),
        });
    }
    let (s, body) = rest.split_at(n);
    Ok((*tag, *flags, s, body))
}

/// The bytes of a request after its credential (lease ids when there are any, then `body`):
/// what the credential's body digest covers (see [`crate::auth::AuthKey::sign_body`]).
pub fn request_tail(releases: &[u64], body: &[u8]) -> Vec<u8> {
    let mut tail = releases_bytes(releases);
    tail.extend_from_slice(body);
    tail
}

/// The lease-id part of a request (empty without releases).
fn releases_bytes(releases: &[u64]) -> Vec<u8> {
    let releases = &releases[..releases.len().min(MAX_RELEASES)];
    let mut extra = Vec::new();
    if !releases.is_empty() {
        extra.reserve(2 + 8 * releases.len());
        extra.extend_from_slice(&(releases.len() as u16).to_le_bytes());
        for id in releases {
            extra.extend_from_slice(&id.to_le_bytes());
        }
    }
    extra
}

/// Append a request frame to `out`; `releases` (at most [`MAX_RELEASES`]; more are left
/// out) are the lease ids the master releases before it runs the call.
pub fn encode_request(
    out: &mut Vec<u8>,
    method: Method,
    credential: &str,
    releases: &[u64],
    body: &[u8],
) {
    let extra = releases_bytes(releases);
    let flags = if releases.is_empty() {
        0
    } else {
        FLAG_RELEASES
    };
    frame(
        out,
        method as u8,
        flags,
        credential.as_bytes(),
        &extra,
        body,
    );
}

/// A decoded request.
#[derive(Debug, PartialEq, Eq)]
pub struct RequestFrame<'a> {
    pub method: Method,
    pub credential: &'a str,
    /// Leases to release before the call.
    pub releases: Vec<u64>,
    /// The call's protobuf message.
    pub body: &'a [u8],
}

/// The head of a request frame (its first 4 bytes after `len`): method, flags, credential
/// length. A server reads it, then the credential, and checks the credential before it reads
/// (and allocates for) the rest of a frame of `len` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestHead {
    pub method: Method,
    flags: u8,
    pub credential_len: usize,
}

/// Bytes of a request's head.
pub const REQUEST_HEAD: usize = HEAD;

/// Decode a request's head, for a frame of `len` bytes (after its `len` field).
pub fn decode_head(head: [u8; REQUEST_HEAD], len: usize) -> Result<RequestHead, FrameError> {
    if len < HEAD {
        return Err(FrameError::Short(len));
    }
    let [tag, flags, a, b] = head;
    let method = Method::from_repr(tag).ok_or(FrameError::UnknownMethod(tag))?;
    if flags & !FLAG_RELEASES != 0 {
        return Err(FrameError::Flags(flags));
    }
    let credential_len = u16::from_le_bytes([a, b]) as usize;
    let have = len.saturating_sub(HEAD);
    if credential_len > have {
        return Err(FrameError::Truncated {
            what: "head string",
            want: credential_len,
            have,
        });
    }
    Ok(RequestHead {
        method,
        flags,
        credential_len,
    })
}

/// The credential bytes of a request as text.
pub fn decode_credential(bytes: &[u8]) -> Result<&str, FrameError> {
    std::str::from_utf8(bytes).map_err(|_| FrameError::Credential)
}

/// What follows a request's credential: the lease ids to release (when flagged) and the
/// protobuf body.
pub fn decode_tail<'a>(
    head: &RequestHead,
    mut rest: &'a [u8],
) -> Result<(Vec<u64>, &'a [u8]), FrameError> {
    let mut releases = Vec::new();
    if head.flags & FLAG_RELEASES != 0 {
        let [a, b, after @ ..] = rest else {
            return Err(FrameError::Truncated {
                what: "lease count",
                want: 2,
                have: rest.len(),
            });
        };
        let n = u16::from_le_bytes([*a, *b]) as usize;
        if n > MAX_RELEASES {
            return Err(FrameError::TooManyReleases(n));
        }
        if after.len() < 8 * n {
            return Err(FrameError::Truncated {
                what: "lease ids",
                want: 8 * n,
                have: after.len(),
            });
        }
        let (ids, body) = after.split_at(8 * n);
        releases = ids
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        rest = body;
    }
    Ok((releases, rest))
}

/// A whole request frame (without its `len`), decoded at once.
pub fn decode_request(frame: &[u8]) -> Result<RequestFrame<'_>, FrameError> {
    let [a, b, c, d, rest @ ..] = frame else {
        return Err(FrameError::Short(frame.len()));
    };
    let head = decode_head([*a, *b, *c, *d], frame.len())?;
    let (cred, tail) = rest.split_at(head.credential_len);
    let credential = decode_credential(cred)?;
    let (releases, body) = decode_tail(&head, tail)?;
    Ok(RequestFrame {
        method: head.method,
        credential,
        releases,
        body,
    })
}

/// Append a reply frame to `out`: `code` 0 with the protobuf `body`, or a gRPC status code
/// with its message as `body`; `hint` is the leader's address, when known.
pub fn encode_reply(out: &mut Vec<u8>, code: u8, hint: &str, body: &[u8]) {
    frame(out, code, 0, hint.as_bytes(), &[], body);
}

/// A reply frame (without its `len`): code, leader hint (may be empty), body.
pub fn decode_reply(frame: &[u8]) -> Result<(u8, &[u8], &[u8]), FrameError> {
    let (code, reserved, hint, body) = split(frame)?;
    if reserved != 0 {
        return Err(FrameError::Reserved(reserved));
    }
    Ok((code, hint, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body_of(buf: &[u8]) -> &[u8] {
        let len = u32::from_le_bytes(buf[..4].try_into().unwrap()) as usize;
        assert_eq!(len, buf.len() - 4);
        &buf[4..]
    }

    #[test]
    fn requests_and_replies_round_trip() {
        let mut buf = Vec::new();
        encode_request(&mut buf, Method::PutStart, "v1.1.ab.cd", &[], b"\x0a\x01k");
        let r = decode_request(body_of(&buf)).unwrap();
        assert_eq!(
            (r.method, r.credential, r.releases.as_slice(), r.body),
            (Method::PutStart, "v1.1.ab.cd", &[][..], &b"\x0a\x01k"[..])
        );

        let mut buf = Vec::new();
        encode_request(&mut buf, Method::Get, "cred", &[7, u64::MAX], b"body");
        let r = decode_request(body_of(&buf)).unwrap();
        assert_eq!(
            (r.releases.as_slice(), r.body),
            (&[7, u64::MAX][..], &b"body"[..])
        );

        let mut buf = Vec::new();
        encode_reply(&mut buf, 14, "10.0.0.2:50051", b"standby");
        let (code, hint, body) = decode_reply(body_of(&buf)).unwrap();
        assert_eq!(
            (code, hint, body),
            (14, &b"10.0.0.2:50051"[..], &b"standby"[..])
        );
    }

    #[test]
    fn every_method_maps_to_its_grpc_name_and_back() {
        for tag in 0..=255u8 {
            if let Some(m) = Method::from_repr(tag) {
                assert_eq!(Method::from_name(m.name()), Some(m), "{m:?}");
                assert!(crate::auth::METHODS.contains(&m.grpc_name()), "{m:?}");
                assert_eq!(
                    m.grpc_name().to_lowercase(),
                    m.name().replace('_', ""),
                    "{m:?}"
                );
            }
        }
        assert_eq!(Method::from_name("mount_segment"), None);
    }

    #[test]
    fn malformed_frames_are_refused_with_a_reason() {
        assert_eq!(decode_request(b"\x01\x00"), Err(FrameError::Short(2)));
        assert_eq!(
            decode_request(b"\x01\x06\x00\x00"),
            Err(FrameError::Flags(6))
        );
        assert_eq!(
            decode_reply(b"\x00\x07\x00\x00"),
            Err(FrameError::Reserved(7))
        );
        assert_eq!(
            decode_request(b"\x01\x01\x00\x00\x02\x00\x01"),
            Err(FrameError::Truncated {
                what: "lease ids",
                want: 16,
                have: 1
            })
        );
        assert!(matches!(
            decode_request(b"\x01\x01\x00\x00\xff\xff"),
            Err(FrameError::TooManyReleases(65535))
        ));
        assert_eq!(
            decode_request(b"\x01\x00\x09\x00abc"),
            Err(FrameError::Truncated {
                what: "head string",
                want: 9,
                have: 3
            })
        );
        assert_eq!(
            decode_request(b"\xee\x00\x00\x00"),
            Err(FrameError::UnknownMethod(0xee))
        );
        assert_eq!(
            decode_request(b"\x01\x00\x01\x00\xff"),
            Err(FrameError::Credential)
        );
        assert_eq!(
            check_len(MAX_FRAME + 1),
            Err(FrameError::TooLarge(MAX_FRAME + 1))
        );
        assert!(check_preface(*b"PRI * HT").is_err());
        check_preface(PREFACE).unwrap();
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for n in 0..2000usize {
            let frame: Vec<u8> = (0..n % 40)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let _ = decode_request(&frame);
            let _ = decode_reply(&frame);
        }
    }
}
