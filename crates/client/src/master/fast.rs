//! The client side of the master's fast lane (wire format in [`kvpool_proto::fast`]), used by
//! [forks](super::MasterClient::fork): a blocking TCP connection of the fork's own, one call at
//! a time, on the thread that waits for the answer anyway, over TLS when the client has it.
//! Whatever the lane cannot do (a master that does not speak it, a broken connection, a standby's
//! UNAVAILABLE) is left to the gRPC path, which owns retries and leader failover.
//! I/O boundary: the fast-lane socket.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use prost::Message;
use tonic::Code;

use super::MasterClient;
use super::connection;
use super::error::ClientError;
use super::tls::FastStream;
use kvpool_proto::fast::{self, Method};
use kvpool_proto::master::LEADER_HEADER;

/// A fork's fast lane.
#[derive(Debug, Default)]
pub(super) struct FastLane {
    state: Mutex<State>,
    /// A call went over the lane once: later failures are not taken for a master without it.
    worked: AtomicBool,
    /// Leases of finished reads, released with the next call (see [`FastLane::defer_release`]).
    pending: Mutex<Vec<u64>>,
    /// A flush of `pending` through the parent client is scheduled.
    armed: AtomicBool,
}

/// How long a finished read's lease waits for the next fast-lane call to carry its release
/// before the parent client releases it on its own.
const RELEASE_DELAY: Duration = Duration::from_millis(2);

impl FastLane {
    /// Release `id` with the next call over the lane, or within [`RELEASE_DELAY`] through
    /// `parent` (on its runtime) when no call comes; false when the lane is off (the caller
    /// releases it another way).
    pub(super) fn defer_release(
        self: &Arc<Self>,
        id: u64,
        parent: &Arc<(MasterClient, tokio::runtime::Handle)>,
    ) -> bool {
        if matches!(*self.state.lock(), State::Off) {
            return false;
        }
        self.pending.lock().push(id);
        if !self.armed.swap(true, Ordering::AcqRel) {
            let (lane, root) = (self.clone(), parent.clone());
            parent.1.spawn(async move {
                tokio::time::sleep(RELEASE_DELAY).await;
                lane.armed.store(false, Ordering::Release);
                let ids = std::mem::take(&mut *lane.pending.lock());
                for id in ids {
                    root.0.release_lease_later(id);
                }
            });
        }
        true
    }

    /// Take the leases waiting for a call.
    fn take_pending(&self) -> Vec<u64> {
        std::mem::take(&mut *self.pending.lock())
    }
}

/// Add a new fork's lane to its root's `lanes`, dropping those of forks that are gone.
pub(super) fn register(lanes: &Mutex<Vec<Weak<FastLane>>>, lane: &Arc<FastLane>) {
    let mut lanes = lanes.lock();
    lanes.retain(|l| l.strong_count() > 0);
    lanes.push(Arc::downgrade(lane));
}

/// Take the leases that every live fork of a root still holds for its next call.
pub(super) fn take_all_pending(lanes: &Mutex<Vec<Weak<FastLane>>>) -> Vec<u64> {
    let lanes: Vec<_> = lanes.lock().iter().filter_map(Weak::upgrade).collect();
    lanes.iter().flat_map(|l| l.take_pending()).collect()
}

#[derive(Debug, Default)]
enum State {
    /// No connection yet (or the last one was dropped).
    #[default]
    Idle,
    Open {
        stream: FastStream,
        /// The gRPC endpoint it was opened for.
        endpoint: String,
    },
    /// The master does not speak the fast lane (or cannot be reached by it): gRPC only.
    Off,
}

/// Why a call did not go over the fast lane (the caller then uses gRPC).
enum Skip {
    /// The lane cannot be used for this client (recorded: no further attempts).
    Never(String),
    /// Not this time (the connection is dropped; the next call dials again).
    Now(String),
}

impl MasterClient {
    /// Make the call `method` over the fast lane when this client has one and the lane
    /// carries `method`; `None` when the caller must use gRPC for it.
    pub(super) fn call_fast<Req: Message, Resp: Message + Default>(
        &self,
        method: &'static str,
        req: &Req,
    ) -> Option<Result<Resp, ClientError>> {
        let lane = self.fast.as_ref()?;
        let m = Method::from_name(method)?;
        let endpoint = self.current_target();
        let mut state = lane.state.lock();
        let releases = lane.take_pending();
        let answer = self.fast_call(&mut state, &endpoint, m, &releases, req);
        if answer.is_err() {
            // Not carried (or not known to be): the parent releases them.
            for id in releases {
                self.release_via_parent(id);
            }
        }
        match answer {
            Ok(r) => {
                lane.worked.store(true, Ordering::Relaxed);
                Some(r)
            }
            Err(Skip::Never(why)) if !lane.worked.load(Ordering::Relaxed) => {
                tracing::debug!(endpoint, reason = why, "master fast lane off, using gRPC");
                *state = State::Off;
                None
            }
            Err(Skip::Now(why) | Skip::Never(why)) => {
                tracing::debug!(endpoint, reason = why, "fast-lane call left to gRPC");
                *state = State::Idle;
                None
            }
        }
    }

    fn fast_call<Req: Message, Resp: Message + Default>(
        &self,
        state: &mut State,
        endpoint: &str,
        method: Method,
        releases: &[u64],
        req: &Req,
    ) -> Result<Result<Resp, ClientError>, Skip> {
        let mut out = Vec::with_capacity(64 + req.encoded_len());
        let fresh = match state {
            State::Off => return Err(Skip::Never("off".into())),
            State::Open { endpoint: e, .. } if e == endpoint => false,
            _ => {
                *state = State::Idle;
                out.extend_from_slice(&fast::PREFACE);
                true
            }
        };
        let body = req.encode_to_vec();
        let credential = self
            .signer
            .0
            .sign_body(method.grpc_name(), &fast::request_tail(releases, &body));
        fast::encode_request(&mut out, method, &credential, releases, &body);
        if fresh {
            let stream = self.dial_fast(endpoint)?;
            *state = State::Open {
                stream,
                endpoint: endpoint.to_owned(),
            };
        }
        let State::Open { stream, .. } = state else {
            return Err(Skip::Now("no connection".into()));
        };
        let sent = stream.write_all(&out).and_then(|()| stream.flush());
        if fresh {
            // The answer to the preface tells whether this master speaks the lane at all.
            let mut preface = [0u8; 8];
            if let Err(e) = sent.and_then(|()| stream.read_exact(&mut preface)) {
                return Err(Skip::Never(format!("no fast-lane preface: {e}")));
            }
            fast::check_preface(preface).map_err(|e| Skip::Never(e.to_string()))?;
        } else {
            sent.map_err(|e| Skip::Now(format!("sending: {e}")))?;
        }
        let (code, hint, reply) = read_reply(stream, self.config.spin_wait).map_err(Skip::Now)?;
        if code == 0 {
            return Ok(Resp::decode(reply.as_slice()).map_err(|e| {
                ClientError::Malformed(format!("{} answer does not decode: {e}", method.name()))
            }));
        }
        let code = Code::from_i32(i32::from(code));
        if matches!(code, Code::Unavailable | Code::Cancelled) {
            // A standby or a master going away: gRPC follows the leader.
            return Err(Skip::Now(format!("{code:?}")));
        }
        let mut status = tonic::Status::new(code, String::from_utf8_lossy(&reply).into_owned());
        if let Some(v) = std::str::from_utf8(&hint)
            .ok()
            .filter(|h| !h.is_empty())
            .and_then(|h| h.parse().ok())
        {
            status.metadata_mut().insert(LEADER_HEADER, v);
        }
        if code == Code::Unauthenticated || code == Code::InvalidArgument {
            // The master closes the connection after refusing a call.
            *state = State::Idle;
        }
        Ok(Err(ClientError::Rpc {
            method: method.name(),
            source: status,
        }))
    }

    fn dial_fast(&self, endpoint: &str) -> Result<FastStream, Skip> {
        let hostport = match endpoint.split_once("://") {
            None => endpoint,
            Some(("http" | "https", rest)) => rest,
            Some((scheme, _)) => return Err(Skip::Never(format!("{scheme} endpoint"))),
        };
        let hostport = hostport.trim_end_matches('/');
        let addrs: Vec<_> = hostport
            .to_socket_addrs()
            .map_err(|e| Skip::Now(format!("resolving {hostport}: {e}")))?
            .collect();
        let mut last = io::Error::other("no address");
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, self.config.connect_timeout) {
                Ok(s) => {
                    let timeout = Some(self.config.request_timeout.max(Duration::from_millis(1)));
                    let setup = s
                        .set_nodelay(true)
                        .and_then(|()| s.set_read_timeout(timeout))
                        .and_then(|()| s.set_write_timeout(timeout));
                    if let Err(e) = setup {
                        return Err(Skip::Now(format!("socket options: {e}")));
                    }
                    return match &self.tls {
                        None => Ok(FastStream::Plain(s)),
                        Some(tls) => tls.wrap(s, connection::host(hostport)).map_err(Skip::Never),
                    };
                }
                Err(e) => last = e,
            }
        }
        Err(Skip::Now(format!("connecting to {hostport}: {last}")))
    }
}

/// Read one reply frame: code, leader hint, body (after polling for it up to `spin`).
fn read_reply(stream: &mut FastStream, spin: Duration) -> Result<(u8, Vec<u8>, Vec<u8>), String> {
    use std::os::fd::AsFd;
    if let Some(socket) = stream.plain_socket() {
        // Over TLS a reply may sit decrypted in the buffer already: no polling there.
        kvpool_transfer::wire::spin_until_readable(socket.as_fd(), spin);
    }
    let mut len = [0u8; 4];
    stream
        .read_exact(&mut len)
        .map_err(|e| format!("reading the answer: {e}"))?;
    let len = fast::check_len(u32::from_le_bytes(len)).map_err(|e| e.to_string())?;
    let mut frame = vec![0u8; len];
    stream
        .read_exact(&mut frame)
        .map_err(|e| format!("reading the answer: {e}"))?;
    let (code, hint, body) = fast::decode_reply(&frame).map_err(|e| e.to_string())?;
    Ok((code, hint.to_vec(), body.to_vec()))
}
