//! An in-process RDMA fabric implementing the verbs traits of `datapath` without hardware: tests
//! (in this crate and in tests/) use it where no RDMA device exists. Queue pairs "execute" RDMA
//! WRITE/READ when their completion queue is polled, by copying between the segments registered
//! with the fabric, and faults can be injected per device: failed completions, queue pairs in
//! the error state, a target that never finishes the handshake, completions out of order. Ports
//! are RoCE (Ethernet: addressed by GID) or InfiniBand (addressed by LID); a queue pair connects
//! only when the address vector computed by `address::address_for` reaches the peer's port.
//! No I/O: memory copies only (bounds-checked, through `memory::copy_between`).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use super::address::{self, LinkLayer, PortAttr};
use super::datapath::{
    MemoryKeys, QueuePairOps, RdmaDevice, RdmaError, RdmaOp, RdmaProvider, WorkCompletion,
    WorkRequest,
};
use super::handshake::{MTU_1024, QpInfo};
use crate::memory::{self, Segment};

/// Faults to inject, by device name.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Work requests on these devices complete with a transport error (and their queue pair
    /// goes to the error state, flushing what follows, as an RC queue pair does).
    pub failing_completions: HashSet<String>,
    /// Queue pairs on these devices are in the error state: posting fails at once.
    pub qp_error: HashSet<String>,
    /// Queue pairs on these devices take `connect_delay` to connect (a target that does not
    /// answer the handshake in time).
    pub slow_connect: HashSet<String>,
    pub connect_delay: Duration,
    /// Work requests on these devices never complete (a lost completion, a hung NIC).
    pub silent: HashSet<String>,
    /// Complete each polled group of work requests in reverse order of posting.
    pub reverse_completions: bool,
}

#[derive(Default)]
struct FabricState {
    regions: Mutex<HashMap<u32, Arc<Segment>>>,
    qps: Mutex<HashMap<u32, Weak<FakeQp>>>,
    next_key: AtomicU32,
    next_qpn: AtomicU32,
    faults: Mutex<Faults>,
    /// Bytes moved by successful work requests, per device that posted them.
    moved: Mutex<HashMap<String, u64>>,
    /// The same bytes, per device at the other end (the target's NIC).
    served: Mutex<HashMap<String, u64>>,
}

/// A fabric shared by every fake device of a test (initiator and target alike).
#[derive(Clone, Default, derive_more::Debug)]
pub struct FakeFabric {
    #[debug(skip)]
    state: Arc<FabricState>,
}

impl FakeFabric {
    pub fn new() -> Self {
        Self::default()
    }

    /// A provider whose devices carry these names (best first), on RoCE (Ethernet) ports whose
    /// GID is made from the name.
    pub fn provider(&self, devices: &[&str]) -> Arc<dyn RdmaProvider> {
        let ports: Vec<FakePort> = devices.iter().map(|d| FakePort::roce(d)).collect();
        self.provider_with_ports(&ports)
    }

    /// A provider whose devices sit on InfiniBand ports with these LIDs (best first).
    pub fn provider_ib(&self, devices: &[(&str, u16)]) -> Arc<dyn RdmaProvider> {
        let ports: Vec<FakePort> = devices
            .iter()
            .map(|(d, lid)| FakePort::infiniband(d, *lid))
            .collect();
        self.provider_with_ports(&ports)
    }

    /// A provider with exactly these ports.
    pub fn provider_with_ports(&self, ports: &[FakePort]) -> Arc<dyn RdmaProvider> {
        Arc::new(FakeProvider {
            devices: ports
                .iter()
                .map(|p| {
                    Arc::new(FakeDevice {
                        name: p.name.clone(),
                        port: p.attr,
                        numa_node: p.numa_node,
                        fabric: self.state.clone(),
                    }) as Arc<dyn RdmaDevice>
                })
                .collect(),
        })
    }

    pub fn set_faults(&self, faults: Faults) {
        *self.state.faults.lock() = faults;
    }

    /// Bytes moved by successful work requests posted on `device`.
    pub fn bytes_moved(&self, device: &str) -> u64 {
        self.state.moved.lock().get(device).copied().unwrap_or(0)
    }

    /// Bytes that successful work requests moved through `device` as the remote end (the NIC
    /// on the target side of a one-sided WRITE or READ).
    pub fn bytes_served(&self, device: &str) -> u64 {
        self.state.served.lock().get(device).copied().unwrap_or(0)
    }

    /// Memory regions currently registered on the fabric.
    pub fn registered_regions(&self) -> usize {
        self.state.regions.lock().len()
    }

    /// Queue pairs currently alive on the fabric.
    pub fn live_queue_pairs(&self) -> usize {
        self.state
            .qps
            .lock()
            .values()
            .filter(|q| q.strong_count() > 0)
            .count()
    }
}

/// One fake device and its port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakePort {
    pub name: String,
    pub attr: PortAttr,
    /// NUMA node the device reports (`None`: unknown).
    pub numa_node: Option<u32>,
}

/// A GID whose last bytes spell `name` (the first 8 bytes are the subnet prefix).
fn gid_from(prefix: [u8; 8], name: &str) -> [u8; 16] {
    let mut gid = [0u8; 16];
    for (g, b) in gid.iter_mut().zip(prefix) {
        *g = b;
    }
    for (g, b) in gid.iter_mut().skip(8).zip(name.bytes()) {
        *g = b;
    }
    gid
}

impl FakePort {
    /// A RoCE port: no LID, a GID made from the name, GID index 3 (as RoCE v2 usually is).
    pub fn roce(name: &str) -> FakePort {
        FakePort {
            name: name.to_owned(),
            attr: PortAttr {
                link_layer: LinkLayer::Ethernet,
                lid: 0,
                gid: gid_from([0, 0, 0, 0, 0, 0, 0, 1], name),
                gid_index: 3,
            },
            numa_node: None,
        }
    }

    /// An InfiniBand port with `lid` (0: no subnet manager configured it) in subnet fe80::/64.
    pub fn infiniband(name: &str, lid: u16) -> FakePort {
        FakePort {
            name: name.to_owned(),
            attr: PortAttr {
                link_layer: LinkLayer::InfiniBand,
                lid,
                gid: gid_from([0xfe, 0x80, 0, 0, 0, 0, 0, 0], name),
                gid_index: 0,
            },
            numa_node: None,
        }
    }

    /// The same port on a device that sits on NUMA node `node`.
    pub fn on_numa(mut self, node: u32) -> FakePort {
        self.numa_node = Some(node);
        self
    }
}

struct FakeProvider {
    devices: Vec<Arc<dyn RdmaDevice>>,
}

impl RdmaProvider for FakeProvider {
    fn devices(&self) -> Vec<Arc<dyn RdmaDevice>> {
        self.devices.clone()
    }
}

struct FakeDevice {
    name: String,
    port: PortAttr,
    numa_node: Option<u32>,
    fabric: Arc<FabricState>,
}

impl RdmaDevice for FakeDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn numa_node(&self) -> Option<u32> {
        self.numa_node
    }

    fn port(&self) -> Result<PortAttr, RdmaError> {
        Ok(self.port)
    }

    fn register(&self, segment: &Arc<Segment>) -> Result<Arc<dyn MemoryKeys>, RdmaError> {
        let key = self.fabric.next_key.fetch_add(1, Ordering::Relaxed) + 1;
        self.fabric.regions.lock().insert(key, segment.clone());
        Ok(Arc::new(FakeRegion {
            key,
            addr: segment.addr() as u64,
            len: segment.len() as u64,
            fabric: self.fabric.clone(),
        }))
    }

    fn create_qp(&self) -> Result<Arc<dyn QueuePairOps>, RdmaError> {
        let qpn = self.fabric.next_qpn.fetch_add(1, Ordering::Relaxed) + 1;
        let qp = Arc::new(FakeQp {
            info: QpInfo {
                device: self.name.clone(),
                qp_num: qpn,
                psn: qpn.wrapping_mul(7919) & 0x00ff_ffff,
                lid: self.port.lid,
                gid: self.port.gid,
                mtu: MTU_1024,
            },
            port: self.port,
            state: Mutex::new(QpState::Init),
            queue: Mutex::new(Vec::new()),
            fabric: self.fabric.clone(),
        });
        self.fabric.qps.lock().insert(qpn, Arc::downgrade(&qp));
        Ok(qp)
    }
}

struct FakeRegion {
    key: u32,
    addr: u64,
    len: u64,
    fabric: Arc<FabricState>,
}

impl MemoryKeys for FakeRegion {
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
    fn addr(&self) -> u64 {
        self.addr
    }
    fn size(&self) -> u64 {
        self.len
    }
}

impl Drop for FakeRegion {
    fn drop(&mut self) {
        self.fabric.regions.lock().remove(&self.key);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum QpState {
    Init,
    Rts { remote_qpn: u32 },
    Error,
}

struct FakeQp {
    info: QpInfo,
    port: PortAttr,
    state: Mutex<QpState>,
    queue: Mutex<Vec<WorkRequest>>,
    fabric: Arc<FabricState>,
}

impl Drop for FakeQp {
    fn drop(&mut self) {
        self.fabric.qps.lock().remove(&self.info.qp_num);
    }
}

impl FakeQp {
    fn err(&self, call: &'static str, reason: &str) -> RdmaError {
        RdmaError::verbs(&self.info.device, call, reason)
    }

    /// Run one work request: copy between the regions named by its keys. Returns the device
    /// of the remote queue pair.
    fn execute(&self, wr: &WorkRequest) -> Result<String, String> {
        let QpState::Rts { remote_qpn } = *self.state.lock() else {
            return Err("IBV_WC_WR_FLUSH_ERR (queue pair in error state)".into());
        };
        // Upgrade outside the lock: dropping the last strong reference takes the lock again.
        let peer = self.fabric.qps.lock().get(&remote_qpn).cloned();
        let Some(peer) = peer.and_then(|w| w.upgrade()) else {
            return Err("IBV_WC_RETRY_EXC_ERR (remote queue pair is gone)".into());
        };
        let remote_device = peer.info.device.clone();
        drop(peer);
        let regions = self.fabric.regions.lock();
        let (Some(local), Some(remote)) = (regions.get(&wr.lkey), regions.get(&wr.rkey)) else {
            return Err("IBV_WC_REM_ACCESS_ERR (unknown memory key)".into());
        };
        let (local, remote) = (local.clone(), remote.clone());
        drop(regions);
        let offset_in = |seg: &Segment, addr: u64| addr.checked_sub(seg.addr() as u64);
        let (Some(lo), Some(ro)) = (
            offset_in(&local, wr.local_addr),
            offset_in(&remote, wr.remote_addr),
        ) else {
            return Err("IBV_WC_REM_ACCESS_ERR (address below the region)".into());
        };
        let len = wr.len as usize;
        let copied = match wr.op {
            RdmaOp::Write => memory::copy_between(&local, lo, &remote, ro, len),
            RdmaOp::Read => memory::copy_between(&remote, ro, &local, lo, len),
        };
        copied
            .map(|()| remote_device)
            .map_err(|e| format!("IBV_WC_REM_ACCESS_ERR ({e})"))
    }
}

impl QueuePairOps for FakeQp {
    fn info(&self) -> QpInfo {
        self.info.clone()
    }

    fn connect(&self, remote: &QpInfo) -> Result<(), RdmaError> {
        let delay = {
            let f = self.fabric.faults.lock();
            f.slow_connect
                .contains(&self.info.device)
                .then_some(f.connect_delay)
        };
        if let Some(d) = delay {
            std::thread::sleep(d);
        }
        let av = address::address_for(&self.port, remote).map_err(|source| RdmaError::Address {
            device: self.info.device.clone(),
            source,
        })?;
        // Route the way the fabric would: by LID on InfiniBand, by GID with a GRH on RoCE; the
        // address must reach the port of the queue pair the handshake named.
        // Upgrade outside the lock: dropping the last strong reference takes the lock again.
        let peer = self.fabric.qps.lock().get(&remote.qp_num).cloned();
        let peer_port = peer.and_then(|w| w.upgrade()).map(|q| q.port);
        let Some(peer_port) = peer_port else {
            return Err(self.err("ibv_modify_qp", "RTR: no such remote queue pair"));
        };
        if peer_port.link_layer != self.port.link_layer {
            return Err(self.err(
                "ibv_modify_qp",
                "RTR: the peer's port is on another link layer (no path)",
            ));
        }
        let reaches = match av.grh {
            Some(grh) => grh.dgid == peer_port.gid,
            None => av.dlid == peer_port.lid,
        };
        if !reaches {
            return Err(self.err(
                "ibv_modify_qp",
                "RTR: the address vector does not reach the peer's port",
            ));
        }
        if !(1..=5).contains(&remote.mtu) {
            return Err(self.err("ibv_modify_qp", "RTR: invalid path MTU"));
        }
        *self.state.lock() = QpState::Rts {
            remote_qpn: remote.qp_num,
        };
        Ok(())
    }

    fn post(&self, wr: &WorkRequest) -> Result<(), RdmaError> {
        if self
            .fabric
            .faults
            .lock()
            .qp_error
            .contains(&self.info.device)
        {
            *self.state.lock() = QpState::Error;
        }
        match *self.state.lock() {
            QpState::Rts { .. } => {}
            QpState::Init => return Err(self.err("ibv_post_send", "queue pair is not in RTS")),
            QpState::Error => {
                return Err(self.err("ibv_post_send", "queue pair is in the error state"));
            }
        }
        self.queue.lock().push(*wr);
        Ok(())
    }

    fn poll(&self, max: usize, out: &mut Vec<WorkCompletion>) -> Result<(), RdmaError> {
        if self.fabric.faults.lock().silent.contains(&self.info.device) {
            return Ok(());
        }
        let mut taken: Vec<WorkRequest> = {
            let mut q = self.queue.lock();
            let n = q.len().min(max);
            q.drain(..n).collect()
        };
        let (failing, reverse) = {
            let f = self.fabric.faults.lock();
            (
                f.failing_completions.contains(&self.info.device),
                f.reverse_completions,
            )
        };
        if reverse {
            taken.reverse();
        }
        for wr in taken {
            let result = if failing {
                let was = std::mem::replace(&mut *self.state.lock(), QpState::Error);
                if matches!(was, QpState::Error) {
                    Err("IBV_WC_WR_FLUSH_ERR (queue pair in error state)".into())
                } else {
                    Err("IBV_WC_RETRY_EXC_ERR (transport retry counter exceeded)".into())
                }
            } else {
                self.execute(&wr).map(|remote| {
                    *self.fabric.served.lock().entry(remote).or_default() += u64::from(wr.len);
                })
            };
            if result.is_ok() {
                *self
                    .fabric
                    .moved
                    .lock()
                    .entry(self.info.device.clone())
                    .or_default() += u64::from(wr.len);
            }
            out.push(WorkCompletion {
                wr_id: wr.wr_id,
                result,
            });
        }
        Ok(())
    }
}
