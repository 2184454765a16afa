//! `P2pEngine`: a point-to-point transfer engine for `kvpool.mooncake_engine` (Mooncake's
//! `TransferEngine` API). It owns a kvpool [`TransferEngine`] serving this process's registered
//! memory on a TCP port of its own, with no master: peers name each other by `host:port` (the
//! session id of Mooncake's P2P handshake) and address memory by virtual address. Each
//! registered region is a segment of its own; the region table (`p2p_table`) maps addresses to
//! segments, and peers read it over the transfer engine when an address is not in the copy they
//! keep. Every call that waits releases the GIL. Failures raise `kvpool._native` exceptions;
//! the Python layer turns them into Mooncake's return codes.
//! I/O boundary: the transfer engine's lanes and server (through `kvpool-transfer`).

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hasher};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use kvpool_transfer::{
    Batch, BatchFailed, Endpoint, LocalSegment, MemoryKind, Protocol, RemoteSegment, Segment,
    SegmentDescriptor, TcpServer, TransferEngine, TransferOp, TransferRequest,
};
use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::errors::{Failure, Kind};
use crate::p2p_table::{self as table, Entry};

/// The key of an engine started without a pool key: every such engine knows it, so it
/// authenticates nothing (Mooncake's engine has no authentication either).
pub(crate) const OPEN_KEY: &[u8] = b"kvpool mooncake_engine: no pool key configured";

/// A region of this process registered with the engine.
pub(crate) struct Region {
    pub(crate) len: u64,
    pub(crate) id: u64,
    pub(crate) local: LocalSegment,
    /// Allocated by `allocate` (freed with `free`, not `unregister`).
    pub(crate) managed: bool,
}

/// This process's registered regions, by start address (they never overlap).
pub(crate) struct Local {
    pub(crate) by_start: BTreeMap<usize, Region>,
    /// Ids of this engine: a random high half, so that a restarted peer never serves a region
    /// under an id a previous process used.
    pub(crate) next_id: u64,
    pub(crate) generation: u64,
}

/// What this engine knows of one peer: its regions (from its table) and the segments opened.
pub(crate) struct Peer {
    addr: SocketAddr,
    pub(crate) regions: BTreeMap<u64, Entry>,
    opened: HashMap<u64, RemoteSegment>,
    table: Option<RemoteSegment>,
}

/// A point-to-point transfer engine (see the module docs).
#[pyclass(module = "kvpool._native", frozen)]
pub struct P2pEngine {
    pub(crate) engine: TransferEngine,
    pub(crate) server: TcpServer,
    /// This engine's region table, served to peers.
    pub(crate) table: LocalSegment,
    /// Where table reads from peers land.
    pub(crate) scratch: Mutex<LocalSegment>,
    pub(crate) local: Mutex<Local>,
    pub(crate) peers: Mutex<HashMap<String, Arc<Mutex<Peer>>>>,
    pub(crate) batches: Mutex<HashMap<u64, Arc<Batch>>>,
    pub(crate) next_batch: AtomicU64,
    pub(crate) authenticated: bool,
}

pub(crate) fn transfer_failed(what: &str, e: impl std::fmt::Display) -> Failure {
    Failure::new(Kind::TransferFailed, format!("{what}: {e}"))
}

pub(crate) fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// Where to listen: `host` or `host:port` (an IP address or a name that resolves).
pub(crate) fn listen_addr(hostname: &str) -> Result<SocketAddr, Failure> {
    let h = hostname.trim();
    let h = if h.is_empty() { "127.0.0.1" } else { h };
    if let Ok(a) = h.parse::<SocketAddr>() {
        return Ok(a);
    }
    if let Ok(ip) = h.trim_matches(['[', ']']).parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, 0));
    }
    let (host, port) = match h.rsplit_once(':') {
        Some((host, p)) if p.parse::<u16>().is_ok() => (host, p.parse().unwrap_or(0)),
        _ => (h, 0),
    };
    (host, port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| Failure::invalid(format!("local hostname {hostname:?} does not resolve")))
}

/// The address a session id (`host:port`) names.
pub(crate) fn peer_addr(session: &str) -> Result<SocketAddr, Failure> {
    if let Ok(a) = session.trim().parse::<SocketAddr>() {
        return Ok(a);
    }
    session
        .trim()
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| {
            Failure::new(
                Kind::Unavailable,
                format!("session {session:?} is not a reachable host:port"),
            )
        })
}

pub(crate) fn descriptor(name: &str, addr: SocketAddr, size: u64) -> SegmentDescriptor {
    SegmentDescriptor {
        name: name.to_owned(),
        node: format!("peer {addr}"),
        size,
        numa_node: None,
        memory: MemoryKind::Host,
        gpu_device: None,
        endpoints: vec![Endpoint::Tcp(addr)],
        nics: Vec::new(),
    }
}

pub(crate) fn batch_error(e: BatchFailed) -> Failure {
    Failure::new(Kind::TransferFailed, e.failure.to_string())
}

impl P2pEngine {
    pub(crate) fn publish(&self, local: &mut Local) -> Result<(), Failure> {
        local.generation += 1;
        let mut entries: Vec<Entry> = local
            .by_start
            .iter()
            .map(|(s, r)| Entry {
                start: *s as u64,
                len: r.len,
                id: r.id,
            })
            .collect();
        entries.sort_by_key(|e| e.id);
        self.table
            .segment()
            .write_at(0, &table::encode(local.generation, &entries))
            .map_err(|e| Failure::new(Kind::Internal, format!("region table: {e}")))
    }

    /// Register `ptr..ptr+len` (`owned`: memory this engine allocated).
    pub(crate) fn add_region(
        &self,
        ptr: usize,
        len: u64,
        owned: Option<Arc<Segment>>,
    ) -> PyResult<()> {
        let n = usize::try_from(len)
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| Failure::invalid(format!("region size {len} must be positive")))?;
        let start = NonNull::new(ptr as *mut u8)
            .ok_or_else(|| Failure::invalid("region address 0 is not valid"))?;
        let end = ptr
            .checked_add(n)
            .ok_or_else(|| Failure::invalid("region wraps around the address space"))?;
        let mut local = self.local.lock();
        let overlaps = local
            .by_start
            .range(..end)
            .next_back()
            .is_some_and(|(s, r)| s.saturating_add(r.len as usize) > ptr);
        if overlaps {
            return Err(Failure::new(
                Kind::Exists,
                format!("region {ptr:#x}+{len} overlaps a registered region"),
            )
            .into());
        }
        if local.by_start.len() >= table::MAX_REGIONS {
            return Err(Failure::new(
                Kind::NoSpace,
                format!(
                    "{} regions registered: the most one engine takes",
                    table::MAX_REGIONS
                ),
            )
            .into());
        }
        let managed = owned.is_some();
        let segment = match owned {
            Some(s) => s,
            None => match crate::device::segment(ptr, n)? {
                Some(on_gpu) => on_gpu,
                // SAFETY: Mooncake's contract for register_memory: the caller keeps
                // `ptr..ptr+len` valid until it unregisters it; all accesses are raw copies.
                None => Arc::new(
                    unsafe { Segment::from_raw_parts(start, n, None) }
                        .map_err(|e| Failure::invalid(format!("region {ptr:#x}+{len}: {e}")))?,
                ),
            },
        };
        let id = local.next_id;
        local.next_id += 1;
        let local_seg = self
            .engine
            .register(&table::region_segment(id), segment)
            .map_err(|e| Failure::new(Kind::Internal, format!("registering {ptr:#x}: {e}")))?;
        local.by_start.insert(
            ptr,
            Region {
                len,
                id,
                local: local_seg,
                managed,
            },
        );
        Ok(self.publish(&mut local)?)
    }

    /// The registered region holding `ptr..ptr+len`, and the offset there.
    pub(crate) fn local_span(
        local: &Local,
        ptr: usize,
        len: u64,
    ) -> Result<(LocalSegment, u64), Failure> {
        let (r, offset) = crate::buffers::containing(&local.by_start, |r| r.len, ptr, len)
            .ok_or_else(|| {
                Failure::new(
                    Kind::NotRegistered,
                    format!("local memory {ptr:#x}+{len} is not inside a registered region"),
                )
            })?;
        Ok((r.local.clone(), offset))
    }

    pub(crate) fn peer(&self, session: &str) -> Result<Arc<Mutex<Peer>>, Failure> {
        if let Some(p) = self.peers.lock().get(session) {
            return Ok(p.clone());
        }
        let addr = peer_addr(session)?;
        let peer = Arc::new(Mutex::new(Peer {
            addr,
            regions: BTreeMap::new(),
            opened: HashMap::new(),
            table: None,
        }));
        let mut peers = self.peers.lock();
        if peers.len() >= 4096 {
            peers.clear();
        }
        Ok(peers.entry(session.to_owned()).or_insert(peer).clone())
    }

    /// Open the peer's table segment (kept) and read its regions.
    pub(crate) fn refresh(&self, peer: &mut Peer) -> Result<(), Failure> {
        let desc = descriptor(table::TABLE_SEGMENT, peer.addr, table::TABLE_BYTES as u64);
        let remote = match &peer.table {
            Some(t) => t.clone(),
            None => {
                let t = self
                    .engine
                    .open_descriptor(&desc, Some(Protocol::Tcp))
                    .map_err(|e| {
                        Failure::new(Kind::Unavailable, format!("peer {}: {e}", peer.addr))
                    })?;
                peer.table = Some(t.clone());
                t
            }
        };
        let scratch = self.scratch.lock();
        let read = |len: usize| -> Result<Vec<u8>, Failure> {
            self.engine
                .transfer(vec![TransferRequest {
                    op: TransferOp::Read,
                    local: scratch.clone(),
                    local_offset: 0,
                    remote: remote.clone(),
                    remote_offset: 0,
                    len: len as u64,
                }])
                .map_err(|e| transfer_failed("reading the peer's region table", e.failure))?;
            let mut buf = vec![0u8; len];
            scratch
                .segment()
                .read_at(0, &mut buf)
                .map_err(|e| Failure::new(Kind::Internal, e.to_string()))?;
            Ok(buf)
        };
        for _ in 0..8 {
            let len = table::table_len(&read(table::HEADER)?)?;
            if let Some(entries) = table::decode(&read(len)?)? {
                peer.regions = entries.into_iter().map(|e| (e.start, e)).collect();
                let live: std::collections::HashSet<u64> =
                    peer.regions.values().map(|e| e.id).collect();
                peer.opened.retain(|id, _| live.contains(id));
                return Ok(());
            }
        }
        Err(Failure::new(
            Kind::TransferFailed,
            "the peer's region table kept changing while read",
        ))
    }

    fn find(peer: &Peer, addr: u64, len: u64) -> Option<Entry> {
        let (_, e) = peer.regions.range(..=addr).next_back()?;
        let end = addr.checked_add(len)?;
        (end <= e.start + e.len).then_some(*e)
    }

    /// The remote segment and offset of each `(address, length)` at the peer `session`.
    pub(crate) fn remote_spans(
        &self,
        session: &str,
        ranges: &[(u64, u64)],
    ) -> Result<Vec<(RemoteSegment, u64)>, Failure> {
        let peer = self.peer(session)?;
        let mut peer = peer.lock();
        if ranges
            .iter()
            .any(|(a, l)| Self::find(&peer, *a, *l).is_none())
        {
            self.refresh(&mut peer)?;
        }
        let mut out = Vec::with_capacity(ranges.len());
        for (addr, len) in ranges {
            let e = Self::find(&peer, *addr, *len).ok_or_else(|| {
                Failure::new(
                    Kind::NotRegistered,
                    format!("memory {addr:#x}+{len} is not inside a region {session} registered"),
                )
            })?;
            let seg = match peer.opened.get(&e.id) {
                Some(s) => s.clone(),
                None => {
                    let name = table::region_segment(e.id);
                    let s = self
                        .engine
                        .open_descriptor(&descriptor(&name, peer.addr, e.len), Some(Protocol::Tcp))
                        .map_err(|err| transfer_failed(&format!("opening {name}"), err))?;
                    peer.opened.insert(e.id, s.clone());
                    s
                }
            };
            out.push((seg, addr - e.start));
        }
        Ok(out)
    }

    pub(crate) fn requests(
        &self,
        session: &str,
        write: bool,
        locals: &[usize],
        remotes: &[u64],
        lens: &[u64],
    ) -> Result<Vec<TransferRequest>, Failure> {
        if locals.len() != remotes.len() || locals.len() != lens.len() {
            return Err(Failure::invalid(format!(
                "{} buffers, {} peer addresses and {} lengths: the lists must have one length",
                locals.len(),
                remotes.len(),
                lens.len()
            )));
        }
        let idx: Vec<usize> = (0..lens.len()).filter(|i| lens[*i] > 0).collect();
        let spans: Vec<(LocalSegment, u64)> = {
            let local = self.local.lock();
            idx.iter()
                .map(|i| Self::local_span(&local, locals[*i], lens[*i]))
                .collect::<Result<_, _>>()?
        };
        if idx.is_empty() {
            return Ok(Vec::new());
        }
        let ranges: Vec<(u64, u64)> = idx.iter().map(|i| (remotes[*i], lens[*i])).collect();
        let remote = self.remote_spans(session, &ranges)?;
        let op = if write {
            TransferOp::Write
        } else {
            TransferOp::Read
        };
        Ok(spans
            .into_iter()
            .zip(remote)
            .zip(idx)
            .map(|(((local, lo), (remote, ro)), i)| TransferRequest {
                op,
                local,
                local_offset: lo,
                remote,
                remote_offset: ro,
                len: lens[i],
            })
            .collect())
    }

    /// Forget what is known of `session` (after a failure: the peer may have restarted or
    /// unregistered memory).
    pub(crate) fn forget(&self, session: &str) {
        self.peers.lock().remove(session);
    }

    pub(crate) fn transfer_blocking(
        &self,
        session: &str,
        write: bool,
        locals: &[usize],
        remotes: &[u64],
        lens: &[u64],
    ) -> Result<(), Failure> {
        let first = self
            .requests(session, write, locals, remotes, lens)
            .and_then(|r| {
                if r.is_empty() {
                    return Ok(());
                }
                self.engine.transfer(r).map_err(batch_error)
            });
        let Err(e) = first else { return Ok(()) };
        if !matches!(e.kind, Kind::TransferFailed | Kind::Unavailable) {
            return Err(e);
        }
        self.forget(session);
        // Once more with the peer's table read again (a region unregistered and registered
        // again, or a restarted peer); a peer that is gone fails the same way again.
        let again = self.requests(session, write, locals, remotes, lens)?;
        let done = self.engine.transfer(again).map_err(batch_error);
        if done.is_err() {
            self.forget(session);
        }
        done
    }

    pub(crate) fn notify_blocking(
        &self,
        session: &str,
        name: &str,
        msg: &[u8],
    ) -> Result<(), Failure> {
        let peer = self.peer(session)?;
        let mut peer = peer.lock();
        if peer.table.is_none() {
            self.refresh(&mut peer)?;
        }
        let remote = peer
            .table
            .clone()
            .ok_or_else(|| Failure::new(Kind::Unavailable, "peer table not open"))?;
        let mut payload = (name.len() as u32).to_le_bytes().to_vec();
        payload.extend_from_slice(name.as_bytes());
        payload.extend_from_slice(msg);
        self.engine
            .notify(&remote, &payload)
            .map_err(|e| transfer_failed("sending the notification", e))
    }
}
