//! Blocking frame I/O over any byte stream (TCP or Unix socket): reading a header without losing
//! partial bytes across socket timeouts, writing header + small payloads, and the HMAC
//! challenge-response handshake. I/O boundary: the `Read`/`Write` stream passed in.

use std::io::{self, Read, Write};

use super::auth::{AuthKey, NONCE_LEN, PROOF_LEN};
use super::frame::{ErrorCode, FrameError, HEADER_LEN, Header, MAX_CONTROL_PAYLOAD, Opcode};
use super::seal::{
    Integrity, OPT_ENCRYPTED, OPT_INTEGRITY, RecordFormat, SessionKeys, is_integrity,
};

/// Errors of frame I/O and the handshake.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("connection I/O failed")]
    Io(#[source] io::Error),
    #[error("peer closed the connection")]
    Closed,
    #[error("invalid frame from peer")]
    Frame(#[source] FrameError),
    #[error("unexpected {got:?} frame, expected {expected}")]
    Unexpected { got: Opcode, expected: &'static str },
    #[error("authentication failed: {0}")]
    Auth(String),
    #[error("peer answered with error {code}: {reason}")]
    Remote { code: &'static str, reason: String },
    /// TLS refused or failed; `reason` is the `tls` module's failure label (`unknown_issuer`,
    /// `wrong_name`, `timeout`, ...).
    #[error("TLS failed ({reason}): {detail}")]
    Tls {
        reason: &'static str,
        detail: String,
    },
}

impl WireError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        match self {
            WireError::Io(e) => io_category(e),
            WireError::Closed => "peer_closed",
            WireError::Frame(_) => "malformed",
            WireError::Unexpected { .. } => "protocol",
            WireError::Auth(_) => "auth",
            WireError::Remote { .. } => "remote",
            WireError::Tls { .. } => "tls",
        }
    }
}

/// Short label of an I/O error for metrics: `timeout`, `integrity` (a sealed record failed its
/// check, see `seal`) or `io`.
pub fn io_category(e: &io::Error) -> &'static str {
    if is_timeout(e) {
        "timeout"
    } else if is_integrity(e) {
        "integrity"
    } else if is_local_fault(e) {
        // This side's memory (a caller's buffer no longer mapped), never the peer's doing.
        "local_memory"
    } else {
        "io"
    }
}

/// Whether `e`, or an error it wraps (a segment's `MemoryError::Fault` inside a sealed or TLS
/// send, say), is EFAULT: a fault of this side's memory.
fn is_local_fault(e: &io::Error) -> bool {
    if e.raw_os_error() == Some(libc::EFAULT) {
        return true;
    }
    let mut next: Option<&(dyn std::error::Error + 'static)> = e
        .get_ref()
        .map(|inner| inner as &(dyn std::error::Error + 'static));
    while let Some(err) = next {
        if matches!(
            err.downcast_ref::<crate::memory::MemoryError>(),
            Some(crate::memory::MemoryError::Fault(_))
        ) || err
            .downcast_ref::<io::Error>()
            .is_some_and(|io| io.raw_os_error() == Some(libc::EFAULT))
        {
            return true;
        }
        next = err.source();
    }
    false
}

/// Whether a socket error is a `SO_RCVTIMEO`/`SO_SNDTIMEO` timeout.
pub(crate) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Fill `buf` completely. A socket timeout calls `on_timeout`, which either lets the read
/// continue (Ok) or aborts it (Err). A clean EOF before the first byte is [`WireError::Closed`].
pub fn read_full<R: Read + ?Sized>(
    r: &mut R,
    buf: &mut [u8],
    on_timeout: &mut dyn FnMut() -> io::Result<()>,
) -> Result<(), WireError> {
    let mut done = 0;
    while done < buf.len() {
        match r.read(&mut buf[done..]) {
            Ok(0) if done == 0 => return Err(WireError::Closed),
            Ok(0) => {
                return Err(WireError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "peer closed the connection mid-frame",
                )));
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => on_timeout().map_err(WireError::Io)?,
            Err(e) => return Err(WireError::Io(e)),
        }
    }
    Ok(())
}

/// Give up at the first timeout.
pub fn fail_on_timeout() -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::TimedOut,
        "timed out waiting for the peer",
    ))
}

/// Read and validate one header.
pub fn read_header<R: Read + ?Sized>(
    r: &mut R,
    max_data: u64,
    on_timeout: &mut dyn FnMut() -> io::Result<()>,
) -> Result<Header, WireError> {
    let mut buf = [0u8; HEADER_LEN];
    read_full(r, &mut buf, on_timeout)?;
    Header::decode(&buf, max_data).map_err(WireError::Frame)
}

/// Read a control payload (at most [`MAX_CONTROL_PAYLOAD`], enforced by the decoder).
pub fn read_control_payload<R: Read + ?Sized>(
    r: &mut R,
    header: &Header,
) -> Result<Vec<u8>, WireError> {
    let len = header.payload_len().min(MAX_CONTROL_PAYLOAD) as usize;
    let mut buf = vec![0u8; len];
    read_full(r, &mut buf, &mut fail_on_timeout)?;
    Ok(buf)
}

/// Write a header and an in-memory payload in one buffer (one syscall for small frames).
pub fn write_frame<W: Write + ?Sized>(
    w: &mut W,
    header: &Header,
    payload: &[u8],
) -> Result<(), WireError> {
    let mut h = *header;
    if !matches!(h.opcode, Opcode::Read | Opcode::OpenOk) {
        h.length = payload.len() as u64;
    }
    let mut buf = Vec::with_capacity(HEADER_LEN + payload.len());
    buf.extend_from_slice(&h.encode());
    buf.extend_from_slice(payload);
    w.write_all(&buf).map_err(WireError::Io)
}

/// Write an ERROR reply.
pub fn write_error<W: Write + ?Sized>(
    w: &mut W,
    request_id: u64,
    code: ErrorCode,
    reason: &str,
) -> Result<(), WireError> {
    let mut h = Header::new(Opcode::Error, request_id);
    h.status = code as u32;
    let reason = reason.as_bytes();
    let reason = &reason[..reason.len().min(MAX_CONTROL_PAYLOAD as usize)];
    write_frame(w, &h, reason)
}

/// Turn an ERROR frame into a [`WireError::Remote`] (reads its payload).
pub fn remote_error<R: Read + ?Sized>(r: &mut R, header: &Header) -> WireError {
    match read_control_payload(r, header) {
        Ok(reason) => WireError::Remote {
            code: ErrorCode::from_u32(header.status).as_str(),
            reason: String::from_utf8_lossy(&reason).into_owned(),
        },
        Err(e) => e,
    }
}

/// Initiator side of the handshake: prove knowledge of the key and check that the target knows
/// it too (so data is never written to an impostor).
pub fn client_handshake<S: Read + Write + ?Sized>(
    s: &mut S,
    key: &AuthKey,
) -> Result<(), WireError> {
    client_handshake_opts(s, key, false).map(|_| ())
}

/// The proof labels of a handshake: the options agreed are bound into both proofs, so a
/// man in the middle that changes them fails the handshake.
fn roles(options: u32) -> (&'static [u8], &'static [u8]) {
    if options & OPT_ENCRYPTED != 0 {
        (b"client/integrity/encrypted", b"server/integrity/encrypted")
    } else if options & OPT_INTEGRITY != 0 {
        (b"client/integrity", b"server/integrity")
    } else {
        (b"client", b"server")
    }
}

/// [`client_handshake`], asking for per-frame integrity when `integrity` is set (in encrypted
/// records, or MAC-only ones from a target that predates them): then the target must grant
/// it, and the connection's session keys are returned (see `seal`).
pub(crate) fn client_handshake_opts<S: Read + Write + ?Sized>(
    s: &mut S,
    key: &AuthKey,
    integrity: bool,
) -> Result<Option<SessionKeys>, WireError> {
    let client_nonce: [u8; NONCE_LEN] = rand::random();
    let mut hello = Header::new(Opcode::Hello, 0);
    hello.status = if integrity {
        OPT_INTEGRITY | OPT_ENCRYPTED
    } else {
        0
    };
    write_frame(s, &hello, &client_nonce)?;
    let h = read_reply(s, Opcode::Challenge, "CHALLENGE")?;
    let payload = read_control_payload(s, &h)?;
    if payload.len() != NONCE_LEN + PROOF_LEN {
        return Err(WireError::Auth(format!(
            "challenge of {} bytes, expected {}",
            payload.len(),
            NONCE_LEN + PROOF_LEN
        )));
    }
    let granted = h.status & (OPT_INTEGRITY | OPT_ENCRYPTED);
    if granted == OPT_ENCRYPTED {
        return Err(WireError::Auth(
            "the target granted encrypted records without per-frame integrity".into(),
        ));
    }
    if integrity && granted == 0 {
        return Err(WireError::Auth(
            "the target did not grant per-frame integrity (it predates it or its integrity \
             setting is off)"
                .into(),
        ));
    }
    if !integrity && granted != 0 {
        return Err(WireError::Auth(
            "the target granted per-frame integrity that was not asked for".into(),
        ));
    }
    let (client_role, server_role) = roles(granted);
    let (server_nonce, server_proof) = payload.split_at(NONCE_LEN);
    if !key.verify(server_role, &client_nonce, server_nonce, server_proof) {
        return Err(WireError::Auth(
            "the target does not hold the pool's key".into(),
        ));
    }
    let proof = key.prove(client_role, &client_nonce, server_nonce);
    write_frame(s, &Header::new(Opcode::Auth, 0), &proof)?;
    read_reply(s, Opcode::AuthOk, "AUTH_OK")?;
    Ok((granted != 0).then(|| {
        SessionKeys::derive(
            key,
            &client_nonce,
            server_nonce,
            RecordFormat::from_options(granted),
        )
    }))
}

/// Initiator side: read the target's next handshake frame, which must be `want` (`expected`
/// names it in the error); an ERROR frame becomes [`WireError::Remote`].
fn read_reply<S: Read + ?Sized>(
    s: &mut S,
    want: Opcode,
    expected: &'static str,
) -> Result<Header, WireError> {
    let h = read_header(s, 0, &mut fail_on_timeout)?;
    if h.opcode == Opcode::Error {
        return Err(remote_error(s, &h));
    }
    expect(h, want, expected)
}

/// `h` if it is a `want` frame, else [`WireError::Unexpected`] (`expected` names `want`).
fn expect(h: Header, want: Opcode, expected: &'static str) -> Result<Header, WireError> {
    if h.opcode != want {
        return Err(WireError::Unexpected {
            got: h.opcode,
            expected,
        });
    }
    Ok(h)
}

/// Target side of the handshake. On failure an ERROR frame is sent (best effort) and the caller
/// must close the connection.
pub fn server_handshake<S: Read + Write + ?Sized>(
    s: &mut S,
    key: &AuthKey,
) -> Result<(), WireError> {
    server_handshake_opts(s, key, Integrity::Allow).map(|_| ())
}

/// [`server_handshake`] under an integrity policy: the session keys when the initiator asked for
/// per-frame integrity and `integrity` grants it; an initiator asking for it from a target set
/// to `off`, or not asking one set to `require`, is refused with ERROR(unsupported).
pub(crate) fn server_handshake_opts<S: Read + Write + ?Sized>(
    s: &mut S,
    key: &AuthKey,
    integrity: Integrity,
) -> Result<Option<SessionKeys>, WireError> {
    let result = server_handshake_inner(s, key, integrity);
    if let Err(e) = &result
        && !matches!(e, WireError::Io(_) | WireError::Closed)
    {
        let code = match e {
            WireError::Remote { .. } => ErrorCode::Unsupported,
            _ => ErrorCode::Unauthenticated,
        };
        let reason = match e {
            WireError::Remote { reason, .. } => reason.clone(),
            other => other.to_string(),
        };
        let _ = write_error(s, 0, code, &reason);
    }
    result
}

fn server_handshake_inner<S: Read + Write + ?Sized>(
    s: &mut S,
    key: &AuthKey,
    integrity: Integrity,
) -> Result<Option<SessionKeys>, WireError> {
    let hello = read_header(s, 0, &mut fail_on_timeout)?;
    let client_nonce = read_control_payload(s, &expect(hello, Opcode::Hello, "HELLO")?)?;
    if client_nonce.len() != NONCE_LEN {
        return Err(WireError::Auth(format!(
            "hello nonce of {} bytes, expected {NONCE_LEN}",
            client_nonce.len()
        )));
    }
    let asked = hello.status & OPT_INTEGRITY != 0;
    // Refusals travel as ERROR(unsupported) with this reason (see `server_handshake_opts`).
    let refuse = |reason: &str| WireError::Remote {
        code: ErrorCode::Unsupported.as_str(),
        reason: reason.to_owned(),
    };
    match (asked, integrity) {
        (true, Integrity::Off) => {
            return Err(refuse(
                "this target does not allow per-frame integrity on this connection (its \
                 integrity setting is off, or the connection is TLS, which protects every byte \
                 already)",
            ));
        }
        (false, Integrity::Require) => {
            return Err(refuse(
                "this target requires per-frame integrity: set the initiator's integrity to \
                 require",
            ));
        }
        _ => {}
    }
    // Encrypted records when the initiator knows them, MAC-only ones for an older initiator.
    let granted = if asked {
        OPT_INTEGRITY | (hello.status & OPT_ENCRYPTED)
    } else {
        0
    };
    let (client_role, server_role) = roles(granted);
    let server_nonce: [u8; NONCE_LEN] = rand::random();
    let mut challenge = server_nonce.to_vec();
    challenge.extend_from_slice(&key.prove(server_role, &client_nonce, &server_nonce));
    let mut h = Header::new(Opcode::Challenge, 0);
    h.status = granted;
    write_frame(s, &h, &challenge)?;
    let auth = read_header(s, 0, &mut fail_on_timeout)?;
    let proof = read_control_payload(s, &expect(auth, Opcode::Auth, "AUTH")?)?;
    if !key.verify(client_role, &client_nonce, &server_nonce, &proof) {
        return Err(WireError::Auth("wrong key".into()));
    }
    write_frame(s, &Header::new(Opcode::AuthOk, 0), &[])?;
    Ok(asked.then(|| {
        SessionKeys::derive(
            key,
            &client_nonce,
            &server_nonce,
            RecordFormat::from_options(granted),
        )
    }))
}

/// Poll `fd` without sleeping until it is readable or `budget` has passed; whether it became
/// readable. A caller about to block on a reply that usually comes within microseconds spends
/// that time on its core instead of paying a sleep and a wake-up (tens of microseconds on a
/// virtual machine). A zero budget returns at once.
pub fn spin_until_readable(fd: std::os::fd::BorrowedFd<'_>, budget: std::time::Duration) -> bool {
    use std::os::fd::AsRawFd;
    if budget.is_zero() {
        return false;
    }
    let start = std::time::Instant::now();
    loop {
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call; a zero timeout never blocks.
        if unsafe { libc::poll(&mut pfd, 1, 0) } != 0 {
            return true;
        }
        if start.elapsed() >= budget {
            return false;
        }
        std::hint::spin_loop();
    }
}

/// Abort a TCP connection now: the peer gets a reset and whatever this side still had queued
/// to send is thrown away, for every descriptor of the socket (the lane's threads hold
/// clones). A connection given up on must never deliver its old frames later: a WRITE still
/// in the send queue when a network path died would otherwise be retransmitted once the path
/// comes back, and land on remote memory that may by then belong to another object. A plain
/// `shutdown` or `close` keeps sending the queued bytes (the kernel retransmits them for
/// minutes, even after the last descriptor is closed).
pub fn abort(stream: &std::net::TcpStream) {
    use nix::sys::socket::{setsockopt, sockopt};
    use std::os::fd::AsRawFd;
    // A zero linger makes the final close reset too (should the disconnect below fail).
    let _ = setsockopt(
        stream,
        sockopt::Linger,
        &libc::linger {
            l_onoff: 1,
            l_linger: 0,
        },
    );
    // connect() to an AF_UNSPEC address dissolves a TCP connection at once (Linux:
    // tcp_disconnect): a reset is sent, both queues are purged and blocked callers wake up.
    let unspec = libc::sockaddr {
        sa_family: libc::AF_UNSPEC as libc::sa_family_t,
        sa_data: [0; 14],
    };
    // SAFETY: a valid sockaddr of the length passed, read only during the call; the
    // descriptor is owned by `stream`, which outlives the call.
    let _ = unsafe {
        libc::connect(
            stream.as_raw_fd(),
            &unspec,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    };
    let _ = stream.shutdown(std::net::Shutdown::Both);
}
