//! The master's fast lane (wire format in [`kvpool_proto::fast`]): on the gRPC port, a
//! connection whose first bytes are the fast-lane preface is served here, every other one by
//! the gRPC server. A fast-lane call is decoded, checked with the same [`Verifier`] (and its
//! body against the credential's digest) and run by
//! the same tonic handler (so metrics, the leader gate and persistence are the gRPC API's),
//! on the connection's own task: no HTTP/2 framing, no task per call. Connections are admitted
//! under the caps of [`ConnLimits`] and must authenticate by its deadline; with TLS on, the
//! handshake comes first (see `tls`) and the lanes are told apart by the decrypted bytes.
//! I/O boundary: the accepted connections.

use kvpool_runtime::telemetry::chain;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Request, Status};

use super::MasterSvc;
use super::auth;
use super::limits::{ConnLimits, GrpcConn};
use super::tls::{MasterIo, OpenError, Step, open};
use super::tls_config::ReloadingTls;
use kvpool_proto::auth::{AuthError, Verifier};
use kvpool_proto::fast::{self, Method};
use kvpool_proto::master::{self as proto, LEADER_HEADER, master_server::Master as _};
use kvpool_runtime::http::ConnectionCaps;

/// How long a fast-lane connection may wait before its first call's length arrives (the
/// handshake deadline of `ConnLimits` bounds the preface and the first call as a whole).
const FIRST_BYTES: Duration = Duration::from_secs(10);
/// Once a call's length arrived, the rest of it must follow within this.
const FRAME: Duration = Duration::from_secs(30);

/// Accept connections on `listener` until `shutdown`, within the caps of `limits`: fast-lane
/// ones are served here, the others go to `grpc` (the gRPC server's incoming stream). A
/// connection silent until the handshake deadline is closed.
pub(super) async fn route(
    listener: TcpListener,
    grpc: mpsc::Sender<io::Result<GrpcConn>>,
    svc: MasterSvc,
    verifier: Verifier,
    limits: ConnLimits,
    tls: Option<Arc<ReloadingTls>>,
    shutdown: CancellationToken,
) {
    let caps = Arc::new(ConnectionCaps::default());
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => return,
            r = listener.accept() => r,
        };
        let (stream, peer) = match accepted {
            Ok((s, a)) => (s, a),
            Err(e) => {
                // Out of descriptors and the like: wait a little instead of spinning.
                tracing::warn!(error = %chain(&e), "accepting a master connection failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let source = peer.ip();
        let slot = match caps.admit(
            source,
            limits.max_connections,
            limits.max_connections_per_source,
        ) {
            Ok(slot) => slot,
            Err(reason) => {
                svc.core.metrics.conn_refused(reason);
                tracing::debug!(%source, reason, "refusing a master connection");
                continue;
            }
        };
        // No Nagle: a reply must not wait for the client's delayed ACK (40 ms on Linux).
        let _ = stream.set_nodelay(true);
        let (grpc, svc, verifier, shutdown) = (
            grpc.clone(),
            svc.clone(),
            verifier.clone(),
            shutdown.clone(),
        );
        // The configuration serving now (a reload swaps it for later connections only).
        let tls = tls.as_ref().map(|t| t.acceptor());
        tokio::spawn(async move {
            let until = Instant::now() + limits.handshake_timeout;
            let mut step = Step::Tls;
            let opened = tokio::time::timeout_at(until, open(stream, tls.as_ref(), &mut step));
            match opened.await {
                Ok(Ok((stream, true))) => {
                    let idle = limits.idle_timeout;
                    serve_conn(stream, peer, svc, verifier, (until, idle), shutdown).await;
                    drop(slot);
                }
                Ok(Ok((stream, false))) => {
                    let left = until.saturating_duration_since(Instant::now());
                    let metrics = &svc.core.metrics;
                    let cuts = [
                        metrics.conn_refused_counter("grpc_unauthenticated"),
                        metrics.conn_refused_counter("idle"),
                    ];
                    let conn = GrpcConn::new(stream, slot, left, limits.idle_timeout, cuts);
                    let _ = grpc.send(Ok(conn)).await;
                }
                Err(_) if step == Step::Tls => {
                    svc.core.metrics.conn_refused("handshake_timeout");
                }
                Err(_) => svc.core.metrics.conn_refused("silent"),
                Ok(Err(OpenError::NotTls(first))) => {
                    tracing::warn!(
                        %peer,
                        first_byte = first,
                        "refusing a connection to the master's TLS port: it did not start a \
                         TLS handshake (a plaintext client?)"
                    );
                    svc.core.metrics.conn_refused("tls_handshake");
                }
                Ok(Err(OpenError::Handshake(e))) => {
                    tracing::warn!(%peer, error = %chain(&e), "TLS handshake with a master client failed");
                    svc.core.metrics.conn_refused("tls_handshake");
                }
                Ok(Err(OpenError::Closed)) => {} // closed or broken before a byte: nothing to serve
            }
        });
    }
}

/// Serve one fast-lane connection: the preface, then calls one at a time until the client
/// closes, a frame is malformed, a credential is refused, the connection idles, or shutdown.
async fn serve_conn(
    mut stream: MasterIo,
    peer: SocketAddr,
    svc: MasterSvc,
    verifier: Verifier,
    (until, idle): (Instant, Duration),
    shutdown: CancellationToken,
) {
    let peer = peer.to_string();
    let mut preface = [0u8; 8];
    let ok = tokio::time::timeout_at(until, stream.read_exact(&mut preface)).await;
    if !matches!(ok, Ok(Ok(_))) {
        if ok.is_err() {
            svc.core.metrics.conn_refused("handshake_timeout");
        }
        return;
    }
    let metrics = svc.core.metrics.clone();
    if let Err(e) = fast::check_preface(preface) {
        tracing::debug!(%peer, error = %chain(&e), "fast-lane connection refused");
        metrics.fast_refused("preface");
        return;
    }
    if write(&mut stream, &fast::PREFACE).await.is_err() {
        return;
    }
    metrics.fast_connection(1);
    // The first call's credential must check out by the handshake deadline, however slowly
    // its bytes come; after that only the per-frame and idle limits apply.
    let authenticated = AtomicBool::new(false);
    let calls = serve_calls(
        &mut stream,
        &peer,
        &svc,
        &verifier,
        (&shutdown, idle),
        &authenticated,
    );
    tokio::pin!(calls);
    let done = tokio::select! {
        () = calls.as_mut() => true,
        () = tokio::time::sleep_until(until) => false,
    };
    if !done {
        if authenticated.load(Ordering::SeqCst) {
            calls.await;
        } else {
            metrics.conn_refused("handshake_timeout");
        }
    }
    metrics.fast_connection(-1);
}

/// The calls of an accepted fast-lane connection, until it ends.
async fn serve_calls(
    stream: &mut MasterIo,
    peer: &str,
    svc: &MasterSvc,
    verifier: &Verifier,
    (shutdown, idle): (&CancellationToken, Duration),
    authenticated: &AtomicBool,
) {
    let metrics = &svc.core.metrics;
    let mut frame = Vec::new();
    let mut out = Vec::new();
    let mut wait = FIRST_BYTES;
    loop {
        let len = tokio::select! {
            () = shutdown.cancelled() => return,
            r = tokio::time::timeout(wait, stream.read_u32_le()) => match r {
                Ok(Ok(n)) => n,
                Ok(Err(_)) => return, // closed or broken
                Err(_) => {
                    if authenticated.load(Ordering::SeqCst) {
                        metrics.conn_refused("idle");
                    }
                    return;
                }
            },
        };
        wait = idle;
        let len = match fast::check_len(len) {
            Ok(n) => n,
            Err(e) => {
                metrics.fast_refused("frame");
                refuse(stream, peer, Status::invalid_argument(e.to_string())).await;
                return;
            }
        };
        // The head and the credential first: nothing is allocated for the rest of the frame
        // until the credential checks out.
        let mut head = [0u8; fast::REQUEST_HEAD];
        if !read_within(stream, &mut head).await {
            return;
        }
        let head = match fast::decode_head(head, len) {
            Ok(h) => h,
            Err(e) => {
                metrics.fast_refused("frame");
                refuse(stream, peer, Status::invalid_argument(e.to_string())).await;
                return;
            }
        };
        frame.resize(head.credential_len, 0);
        if !read_within(stream, &mut frame).await {
            return;
        }
        let method = head.method.grpc_name();
        let checked = fast::decode_credential(&frame)
            .map_err(|e| Status::unauthenticated(e.to_string()))
            .and_then(|c| auth::check(verifier, &svc.core, Some(c), method));
        let verified = match checked {
            Ok(v) => v,
            Err(s) => {
                tracing::debug!(%peer, error = %s.message(), "fast-lane call refused");
                metrics.fast_refused(refusal(&s));
                refuse(stream, peer, s).await;
                return;
            }
        };
        authenticated.store(true, Ordering::SeqCst);
        frame.resize(len - fast::REQUEST_HEAD - head.credential_len, 0);
        if !read_within(stream, &mut frame).await {
            return;
        }
        if let Err(e) = verified.check_body(&frame) {
            metrics.fast_refused("unauthenticated");
            refuse(stream, peer, e.status()).await;
            return;
        }
        let (releases, body) = match fast::decode_tail(&head, &frame) {
            Ok(parts) => parts,
            Err(e) => {
                metrics.fast_refused("frame");
                refuse(stream, peer, Status::invalid_argument(e.to_string())).await;
                return;
            }
        };
        out.clear();
        if !releases.is_empty() && !verified.role.allows("ReleaseLeases") {
            let e = AuthError::Forbidden {
                role: verified.role,
                method: "ReleaseLeases".into(),
            };
            metrics.fast_refused("forbidden");
            refuse(stream, peer, e.status()).await;
            return;
        }
        if !releases.is_empty() {
            // The caller's last read is over: release its leases first (a refused one is left
            // to its TTL, as with a background release).
            let req = Request::new(proto::ReleaseLeasesRequest {
                lease_ids: releases,
            });
            if let Err(s) = svc.release_leases(req).await {
                tracing::debug!(%peer, error = %s.message(), "piggybacked lease release failed");
            }
        }
        match dispatch(svc, head.method, body).await {
            Ok(reply) => fast::encode_reply(&mut out, 0, "", &reply),
            Err(s) => encode_status(&mut out, &s),
        }
        if write(stream, &out).await.is_err() {
            return;
        }
    }
}

/// The label of a refused call in `fast_refused`.
fn refusal(s: &Status) -> &'static str {
    match s.code() {
        Code::PermissionDenied => "forbidden",
        Code::Unavailable => "before_leadership",
        _ => "unauthenticated",
    }
}

/// Fill `buf` from `stream` within [`FRAME`]; false when the connection broke or stalled.
async fn read_within(stream: &mut MasterIo, buf: &mut [u8]) -> bool {
    matches!(
        tokio::time::timeout(FRAME, stream.read_exact(buf)).await,
        Ok(Ok(_))
    )
}

/// Answer `status` and close (the connection is not trusted any more).
async fn refuse(stream: &mut MasterIo, peer: &str, status: Status) {
    tracing::debug!(%peer, error = %status.message(), "fast-lane connection closed");
    let mut out = Vec::new();
    encode_status(&mut out, &status);
    let _ = write(stream, &out).await;
    let _ = stream.shutdown().await;
}

/// Write `buf` and flush it (a TLS stream holds records back until flushed).
async fn write(stream: &mut MasterIo, buf: &[u8]) -> std::io::Result<()> {
    stream.write_all(buf).await?;
    stream.flush().await
}

fn encode_status(out: &mut Vec<u8>, s: &Status) {
    let hint = s
        .metadata()
        .get(LEADER_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    // gRPC codes are 1..=16; anything else reads as UNKNOWN.
    let code = u8::try_from(s.code() as i32).unwrap_or(Code::Unknown as u8);
    fast::encode_reply(out, code, hint, s.message().as_bytes());
}

/// Run `method` on its tonic handler; the encoded reply message, or the call's status. The
/// caller has checked the credential (the fuzz target `master_request` calls it directly).
pub async fn dispatch(svc: &MasterSvc, method: Method, body: &[u8]) -> Result<Vec<u8>, Status> {
    use prost::Message;
    fn decode<T: Message + Default>(method: Method, body: &[u8]) -> Result<T, Status> {
        T::decode(body).map_err(|e| {
            Status::invalid_argument(format!("{} request does not decode: {e}", method.name()))
        })
    }
    macro_rules! call {
        ($handler:ident) => {
            svc.$handler(Request::new(decode(method, body)?))
                .await
                .map(|r| r.into_inner().encode_to_vec())
        };
    }
    match method {
        Method::Get => call!(get),
        Method::Exists => call!(exists),
        Method::PutStart => call!(put_start),
        Method::PutEnd => call!(put_end),
        Method::PutRevoke => call!(put_revoke),
        Method::ReleaseLeases => call!(release_leases),
        Method::Remove => call!(remove),
        Method::LongestPrefix => call!(longest_prefix),
    }
}
