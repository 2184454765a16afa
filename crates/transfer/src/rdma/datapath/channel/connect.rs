//! Initiator side of the RDMA handshake: an authenticated control connection to the target,
//! one queue pair per local device, RDMA_CONNECT and its answer, the queue pairs connected and
//! the completion poller started. I/O boundary: the control `TcpStream`.

use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};

use parking_lot::{Condvar, Mutex};

use super::poll::poll_loop;
use super::{ChannelConfig, Path, RdmaChannel, Shared, TcpFallback};
use crate::frame::{self, ErrorCode, Header, Opcode};
use crate::rdma::datapath::{RdmaError, RdmaProvider};
use crate::rdma::handshake::{self, ConnectReply, ConnectRequest};
use crate::rdma::plan::Failover;
use crate::tcp::DialError;
use crate::wire;

/// Interpret the target's answer to RDMA_CONNECT.
fn read_reply(s: &mut TcpStream, peer: &str) -> Result<ConnectReply, RdmaError> {
    let control = |source| RdmaError::Control {
        peer: peer.to_owned(),
        source,
    };
    let h = wire::read_header(s, frame::DEFAULT_MAX_SLICE, &mut wire::fail_on_timeout)
        .map_err(control)?;
    let payload = wire::read_control_payload(s, &h).map_err(control)?;
    reply_from_frame(&h, &payload, peer)
}

/// Pure part of [`read_reply`]: an RDMA_CONNECT_OK payload, or an ERROR turned into the reason
/// why this peer cannot do RDMA.
fn reply_from_frame(h: &Header, payload: &[u8], peer: &str) -> Result<ConnectReply, RdmaError> {
    match h.opcode {
        Opcode::RdmaConnectOk => ConnectReply::decode(payload).map_err(RdmaError::Handshake),
        Opcode::Error => {
            let reason = String::from_utf8_lossy(payload).into_owned();
            let reason = match ErrorCode::from_u32(h.status) {
                // A target built before RDMA_CONNECT existed rejects the opcode as malformed.
                ErrorCode::Malformed => {
                    format!("the target predates RDMA_CONNECT (it answered: {reason})")
                }
                code => format!("{}: {reason}", code.as_str()),
            };
            Err(RdmaError::PeerUnsupported {
                peer: peer.to_owned(),
                reason,
            })
        }
        other => Err(RdmaError::Mismatch {
            peer: peer.to_owned(),
            reason: format!("{other:?} in answer to RDMA_CONNECT"),
        }),
    }
}

impl RdmaChannel {
    /// Initiator side: authenticate a control connection to the target, create one queue pair
    /// per local device, exchange endpoints with RDMA_CONNECT, connect the queue pairs and start
    /// the completion poller. `remote_size` is the segment size from OPEN_OK.
    pub(crate) fn connect(
        provider: &dyn RdmaProvider,
        cfg: &ChannelConfig,
        segment: &str,
        remote_size: u64,
        tcp: Option<TcpFallback>,
    ) -> Result<RdmaChannel, RdmaError> {
        let peer = cfg.peer.to_string();
        let devices: Vec<_> = provider
            .devices()
            .into_iter()
            .take(handshake::MAX_QPS)
            .collect();
        if devices.is_empty() {
            return Err(RdmaError::NoDevice);
        }
        let io_err = |source| RdmaError::Connect {
            peer: peer.clone(),
            source,
        };
        let mut s = cfg.dialer.dial(cfg.peer).map_err(|e| match e {
            DialError::Connect(source) => io_err(source),
            DialError::Handshake(source) => RdmaError::Control {
                peer: peer.clone(),
                source,
            },
        })?;
        let qps = devices
            .iter()
            .map(|d| d.create_qp())
            .collect::<Result<Vec<_>, _>>()?;
        let req = ConnectRequest {
            segment: segment.to_owned(),
            qps: qps.iter().map(|q| q.info()).collect(),
        };
        let payload = req.encode().map_err(RdmaError::Handshake)?;
        wire::write_frame(&mut s, &Header::new(Opcode::RdmaConnect, 1), &payload).map_err(
            |source| RdmaError::Control {
                peer: peer.clone(),
                source,
            },
        )?;
        let reply = read_reply(&mut s, &peer)?;
        if reply.paths.len() != qps.len() {
            return Err(RdmaError::Mismatch {
                peer,
                reason: format!(
                    "{} queue pairs offered, {} answered",
                    qps.len(),
                    reply.paths.len()
                ),
            });
        }
        let mut paths = Vec::with_capacity(qps.len());
        for ((device, qp), (remote_qp, region)) in devices.into_iter().zip(qps).zip(reply.paths) {
            if region.len < remote_size {
                return Err(RdmaError::Mismatch {
                    peer,
                    reason: format!(
                        "registered region of {} bytes is smaller than the segment ({remote_size})",
                        region.len
                    ),
                });
            }
            qp.connect(&remote_qp)?;
            paths.push(Path {
                device,
                qp,
                remote: region,
                local: Mutex::new(HashMap::new()),
            });
        }
        // The control connection now only keeps the target's queue pairs alive.
        s.set_read_timeout(None).map_err(io_err)?;
        let nics = paths.len();
        let shared = Arc::new(Shared {
            peer: peer.clone(),
            paths,
            // Every NIC gets a chance before a slice leaves RDMA.
            failover: Mutex::new(Failover::new(
                nics,
                cfg.max_attempts
                    .max(u32::try_from(nics).unwrap_or(u32::MAX)),
                tcp.is_some(),
            )),
            inflight: Mutex::new(HashMap::new()),
            wake: Condvar::new(),
            next_wr: AtomicU64::new(1),
            next_nic: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            timeout: cfg.dialer.timeout,
            slice_size: cfg.slice_size.clamp(1, u64::from(u32::MAX)),
            tcp,
            retries: AtomicU64::new(0),
            retry_metric: cfg.retry_metric.clone(),
            _control: s,
        });
        let sh = shared.clone();
        let poller = std::thread::Builder::new()
            .name("kvpool-rdma-cq".into())
            .spawn(move || poll_loop(&sh))
            .map_err(io_err)?;
        Ok(RdmaChannel {
            shared,
            poller: Some(poller),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr(opcode: Opcode, status: u32) -> Header {
        let mut h = Header::new(opcode, 1);
        h.status = status;
        h
    }

    #[test]
    fn an_old_target_is_reported_as_predating_rdma_connect() {
        let e = reply_from_frame(
            &hdr(Opcode::Error, ErrorCode::Malformed as u32),
            b"unknown opcode 14",
            "10.0.0.1:7400",
        )
        .unwrap_err();
        assert_eq!(e.category(), "peer_unsupported");
        let text = e.to_string();
        assert!(
            text.contains("predates RDMA_CONNECT") && text.contains("unknown opcode 14"),
            "{text}"
        );
        let e = reply_from_frame(
            &hdr(Opcode::Error, ErrorCode::Unsupported as u32),
            b"no device",
            "p",
        )
        .unwrap_err();
        assert!(e.to_string().contains("unsupported: no device"), "{e}");
        let e = reply_from_frame(&hdr(Opcode::WriteAck, 0), b"", "p").unwrap_err();
        assert_eq!(e.category(), "mismatch");
        let e = reply_from_frame(&hdr(Opcode::RdmaConnectOk, 0), b"\x01", "p").unwrap_err();
        assert_eq!(e.category(), "handshake");
    }
}
