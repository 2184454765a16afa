//! Same-node transport: the owner of a memfd-backed segment hands its file descriptor to an
//! authenticated local peer over a Unix socket (SCM_RIGHTS); the peer maps the same pages and
//! moves bytes with plain memory copies, no socket in the data path.
//! I/O boundary: the Unix listener/stream and `sendmsg`/`recvmsg`.

use std::io::{self, IoSlice, IoSliceMut, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};

use super::auth::AuthKey;
use super::error::TransferError;
use super::frame::{ErrorCode, HEADER_LEN, Header, Opcode};
use super::memory::{self, Segment};
use super::server::Registry;
use super::wire::{self, WireError};

/// A running shared-memory target. Dropping it stops accepting and removes the socket file;
/// mappings already handed out stay valid.
#[derive(Debug)]
pub struct ShmServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl ShmServer {
    pub(crate) fn start(
        path: &Path,
        registry: Arc<Registry>,
        key: AuthKey,
        timeout: Duration,
    ) -> Result<Self, TransferError> {
        let bind_err = |source: io::Error| TransferError::Bind {
            what: format!("Unix socket {}", path.display()),
            source,
        };
        // A stale socket file from a previous run would make bind fail.
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(bind_err(e)),
        }
        let listener = UnixListener::bind(path).map_err(bind_err)?;
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let accept = std::thread::Builder::new()
            .name("kvpool-xfer-shm".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if st.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(mut stream) = conn else { continue };
                    if stream.set_read_timeout(Some(timeout)).is_err()
                        || stream.set_write_timeout(Some(timeout)).is_err()
                    {
                        continue;
                    }
                    if let Err(e) = serve_shm_conn(&mut stream, &registry, &key) {
                        tracing::debug!(error = %e, "shared-memory connection ended");
                    }
                }
            })
            .map_err(bind_err)?;
        Ok(ShmServer {
            path: path.to_owned(),
            stop,
            accept: Some(accept),
        })
    }

    /// Path of the Unix socket.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ShmServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve_shm_conn(s: &mut UnixStream, registry: &Registry, key: &AuthKey) -> Result<(), WireError> {
    wire::server_handshake(s, key)?;
    loop {
        let h = match wire::read_header(s, 0, &mut wire::fail_on_timeout) {
            Ok(h) => h,
            Err(WireError::Closed) => return Ok(()),
            Err(e) => {
                let _ = wire::write_error(s, 0, ErrorCode::Malformed, &e.to_string());
                return Err(e);
            }
        };
        if h.opcode != Opcode::Open {
            let _ = wire::write_error(
                s,
                h.request_id,
                ErrorCode::Unsupported,
                "the shared-memory socket only serves OPEN",
            );
            return Err(WireError::Unexpected {
                got: h.opcode,
                expected: "OPEN",
            });
        }
        let name = wire::read_control_payload(s, &h)?;
        let name = String::from_utf8_lossy(&name).into_owned();
        let found = registry.find(&name);
        let fd = found
            .as_ref()
            .and_then(|(_, seg)| seg.shared_fd().map(|fd| fd.as_raw_fd()));
        match (found.as_ref(), fd) {
            (Some((handle, seg)), Some(fd)) => {
                let mut r = Header::new(Opcode::OpenOk, h.request_id);
                r.handle = *handle;
                r.length = seg.len() as u64;
                let bytes = r.encode();
                let fds = [fd];
                let cmsg = [ControlMessage::ScmRights(&fds)];
                let sent = sendmsg::<()>(
                    s.as_raw_fd(),
                    &[IoSlice::new(&bytes)],
                    &cmsg,
                    MsgFlags::MSG_NOSIGNAL,
                    None,
                )
                .map_err(|e| WireError::Io(e.into()))?;
                if sent != bytes.len() {
                    return Err(WireError::Io(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "short sendmsg",
                    )));
                }
            }
            (Some(_), None) => wire::write_error(
                s,
                h.request_id,
                ErrorCode::Unsupported,
                &format!("segment {name:?} is not memfd-backed and cannot be shared"),
            )?,
            (None, _) => wire::write_error(
                s,
                h.request_id,
                ErrorCode::UnknownSegment,
                &format!("no segment named {name:?} is registered here"),
            )?,
        }
    }
}

/// Connect to a same-node target, authenticate, and map segment `name`.
pub(crate) fn open_shared(
    path: &Path,
    name: &str,
    key: &AuthKey,
    timeout: Duration,
) -> Result<Segment, TransferError> {
    let peer = path.display().to_string();
    let connect_err = |source: io::Error| TransferError::Connect {
        peer: peer.clone(),
        source,
    };
    let mut s = UnixStream::connect(path).map_err(connect_err)?;
    s.set_read_timeout(Some(timeout)).map_err(connect_err)?;
    s.set_write_timeout(Some(timeout)).map_err(connect_err)?;
    wire::client_handshake(&mut s, key).map_err(|source| TransferError::Handshake {
        peer: peer.clone(),
        source,
    })?;
    let open_err = |reason: String| TransferError::Open {
        name: name.to_owned(),
        reason,
    };
    wire::write_frame(&mut s, &Header::new(Opcode::Open, 1), name.as_bytes())
        .map_err(|e| open_err(e.to_string()))?;
    let mut buf = [0u8; HEADER_LEN];
    let mut cmsg_buf = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let (got, fd) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<()>(
            s.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg_buf),
            MsgFlags::empty(),
        )
        .map_err(|e| open_err(format!("recvmsg: {e}")))?;
        let mut received = Vec::new();
        if let Ok(cmsgs) = msg.cmsgs() {
            for c in cmsgs {
                if let ControlMessageOwned::ScmRights(fds) = c {
                    received.extend(memory::adopt_received_fds(fds));
                }
            }
        }
        // Extra descriptors (there should be none) are closed when `received` drops.
        let fd = if received.is_empty() {
            None
        } else {
            Some(received.swap_remove(0))
        };
        (msg.bytes, fd)
    };
    if got == 0 {
        return Err(open_err("the target closed the connection".into()));
    }
    if got < HEADER_LEN {
        s.read_exact(&mut buf[got..])
            .map_err(|e| open_err(format!("short reply: {e}")))?;
    }
    let h = Header::decode(&buf, 0).map_err(|e| open_err(e.to_string()))?;
    match h.opcode {
        Opcode::OpenOk => {}
        Opcode::Error => return Err(open_err(wire::remote_error(&mut s, &h).to_string())),
        other => return Err(open_err(format!("unexpected {other:?} reply"))),
    }
    let fd = fd.ok_or_else(|| open_err("OPEN_OK arrived without a file descriptor".into()))?;
    let size = usize::try_from(h.length).map_err(|_| open_err("segment too large".into()))?;
    Segment::map_fd(fd, size).map_err(|source| TransferError::Map {
        name: name.to_owned(),
        source,
    })
}
