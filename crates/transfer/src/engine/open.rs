//! Opening remote segments: directory lookup, the choice of transport (same-node shared memory,
//! RDMA when wanted and available, TCP otherwise) and the loud fallback from RDMA to TCP.
//! I/O boundary: the OPEN round trip on a peer's first lane, the shared-memory socket and the
//! RDMA control connection (all through the transports).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::TransferEngine;
use super::handles::{RemoteSegment, Route};
use crate::descriptor::{Protocol, SegmentDescriptor};
use crate::error::{TransferError, error_chain};
use crate::frame::{self, Opcode};
use crate::rdma::datapath::{ChannelConfig, RdmaChannel, TcpFallback};
use crate::rdma::{RdmaError, RdmaProvider};
use crate::shm;
use crate::tcp::Peer;

/// Segments [`TransferEngine::open_cached`] keeps at most (all are dropped when full).
const MAX_OPENED: usize = 4096;

/// Attempts of one RDMA slice (first post plus retries on other NICs) before it goes to TCP.
const RDMA_ATTEMPTS: u32 = 3;

/// The error of a descriptor without an endpoint for `protocol`.
fn no_endpoint(desc: &SegmentDescriptor, protocol: Protocol) -> TransferError {
    TransferError::NoEndpoint {
        name: desc.name.clone(),
        protocol,
    }
}

impl TransferEngine {
    /// Open a remote segment by name through the directory, choosing the transport.
    pub fn open(&self, name: &str) -> Result<RemoteSegment, TransferError> {
        let desc = self
            .inner
            .directory
            .lookup(name)
            .map_err(|source| TransferError::Lookup {
                name: name.to_owned(),
                source,
            })?;
        self.open_descriptor(&desc, None)
    }

    /// [`Self::open_descriptor`] without a round trip when the segment was opened before
    /// over TCP: the handle is kept, with the target's instance, so that a target that
    /// restarted refuses it (`unknown_segment`) instead of serving another segment under it.
    /// After such a refusal, [`Self::forget`] the segment and open it again.
    pub fn open_cached(&self, desc: &SegmentDescriptor) -> Result<RemoteSegment, TransferError> {
        let key = desc.tcp_endpoint().map(|a| (desc.name.clone(), a));
        if let Some(k) = &key
            && let Some(seg) = self.inner.opened.lock().get(k)
        {
            return Ok(seg.clone());
        }
        let seg = self.open_descriptor(desc, None)?;
        if let Some(k) = key
            && matches!(seg.route, Route::Tcp(_))
            && seg.instance != 0
        {
            let mut opened = self.inner.opened.lock();
            if opened.len() >= MAX_OPENED {
                opened.clear();
            }
            opened.insert(k, seg.clone());
        }
        Ok(seg)
    }

    /// Drop what [`Self::open_cached`] kept of the segment `remote` names.
    pub fn forget(&self, remote: &RemoteSegment) {
        self.inner
            .opened
            .lock()
            .retain(|(name, _), _| **name != *remote.name);
    }

    /// Open a segment from its descriptor; `protocol` forces a transport (else: shared memory
    /// for same-node segments, RDMA when wanted and available, TCP otherwise).
    pub fn open_descriptor(
        &self,
        desc: &SegmentDescriptor,
        protocol: Option<Protocol>,
    ) -> Result<RemoteSegment, TransferError> {
        let cfg = &self.inner.config;
        let same_node = desc.node == cfg.node;
        match protocol {
            Some(Protocol::Shm) => return self.open_shm(desc),
            Some(Protocol::Tcp) => return self.open_tcp(desc),
            Some(Protocol::Rdma) if self.inner.rdma.is_none() => {
                return Err(TransferError::Unsupported(Protocol::Rdma));
            }
            Some(Protocol::Rdma) | None => {}
        }
        let rdma_wanted = cfg.want_rdma || protocol == Some(Protocol::Rdma);
        if protocol.is_none() && same_node && cfg.prefer_shm && desc.shm_endpoint().is_some() {
            match self.open_shm(desc) {
                Ok(r) => return Ok(r),
                Err(e) => tracing::warn!(
                    segment = %desc.name,
                    error = %error_chain(&e),
                    "same-node shared memory unavailable, using TCP"
                ),
            }
        }
        let tcp = self.open_tcp(desc)?;
        if !rdma_wanted {
            return Ok(tcp);
        }
        let Some(provider) = self.inner.rdma.clone() else {
            self.note_fallback(&desc.name, "no RDMA device on this host");
            return Ok(tcp);
        };
        let Route::Tcp(peer) = &tcp.route else {
            return Ok(tcp);
        };
        match self.connect_rdma(provider.as_ref(), desc, peer, &tcp) {
            Ok(channel) => Ok(RemoteSegment {
                route: Route::Rdma {
                    tcp: peer.clone(),
                    channel: Arc::new(channel),
                },
                ..tcp
            }),
            Err(e) => {
                self.note_fallback(&desc.name, &error_chain(&e));
                Ok(tcp)
            }
        }
    }

    fn connect_rdma(
        &self,
        provider: &dyn RdmaProvider,
        desc: &SegmentDescriptor,
        peer: &Arc<Peer>,
        tcp: &RemoteSegment,
    ) -> Result<RdmaChannel, RdmaError> {
        let cfg = &self.inner.config;
        let metrics = self.inner.metrics.clone();
        let flag = self.inner.fallback_active.clone();
        let last_reason = self.inner.fallback_reason.clone();
        let segment = desc.name.clone();
        let on_fallback: Arc<dyn Fn(&str) + Send + Sync> = Arc::new(move |reason: &str| {
            tracing::warn!(%segment, %reason, "RDMA slice falling back to TCP");
            metrics.fallback.inc();
            flag.store(true, Ordering::SeqCst);
            *last_reason.lock() = Some(format!("{segment}: {reason}"));
        });
        RdmaChannel::connect(
            provider,
            &ChannelConfig {
                peer: peer.addr(),
                dialer: self.inner.dialer.clone(),
                slice_size: cfg.slice_size,
                max_attempts: RDMA_ATTEMPTS,
                retry_metric: self.inner.metrics.rdma_retries.clone(),
            },
            &desc.name,
            tcp.size,
            Some(TcpFallback {
                peer: peer.clone(),
                handle: tcp.handle,
                on_fallback,
            }),
        )
    }

    fn note_fallback(&self, segment: &str, reason: &str) {
        tracing::warn!(%segment, %reason, "falling back from RDMA to TCP");
        self.inner.metrics.fallback.inc();
        self.inner.fallback_active.store(true, Ordering::SeqCst);
        *self.inner.fallback_reason.lock() = Some(format!("{segment}: {reason}"));
    }

    fn open_shm(&self, desc: &SegmentDescriptor) -> Result<RemoteSegment, TransferError> {
        let path = desc
            .shm_endpoint()
            .ok_or_else(|| no_endpoint(desc, Protocol::Shm))?;
        let seg = Arc::new(shm::open_shared(
            path,
            &desc.name,
            &self.inner.key,
            self.inner.config.timeout,
        )?);
        Ok(RemoteSegment {
            name: desc.name.as_str().into(),
            size: seg.len() as u64,
            handle: 0,
            instance: 0,
            vectored: false,
            route: Route::Shm(seg),
        })
    }

    fn open_tcp(&self, desc: &SegmentDescriptor) -> Result<RemoteSegment, TransferError> {
        let addr = desc
            .tcp_endpoint()
            .ok_or_else(|| no_endpoint(desc, Protocol::Tcp))?;
        let peer = self.inner.peers.get(addr);
        peer.connect_first()?;
        let reply = self
            .control(&peer, Opcode::Open, desc.name.as_bytes().to_vec())
            .map_err(|f| TransferError::Open {
                name: desc.name.clone(),
                reason: f.to_string(),
            })?;
        Ok(RemoteSegment {
            name: desc.name.as_str().into(),
            size: reply.length,
            handle: reply.handle,
            instance: reply.status,
            vectored: reply.offset & frame::FEATURE_VECTORED != 0,
            route: Route::Tcp(peer),
        })
    }
}
