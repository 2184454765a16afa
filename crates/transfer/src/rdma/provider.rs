//! The production implementation of the datapath's verbs traits over `verbs` (libibverbs):
//! NICs chosen by `select` from the sysfs `topology`, opened once; one RC queue pair per path with a random
//! initial PSN. No `unsafe` here: every FFI call is in `verbs`.
//! I/O boundary: sysfs reads (topology) and libibverbs calls (through `verbs`).

use std::path::Path;
use std::sync::Arc;

use super::address::{self, PortAttr};
use super::datapath::{
    MemoryKeys, QueuePairOps, RdmaDevice, RdmaError, RdmaOp, RdmaProvider, WorkCompletion,
    WorkRequest,
};
use super::handshake::{MTU_1024, QpInfo};
use super::select::{self, NicPolicy};
use super::topology;
use super::verbs::{self, VerbsError};
use crate::memory::Segment;

/// Opened RDMA NICs of this host, best first.
pub struct VerbsProvider {
    devices: Vec<Arc<dyn RdmaDevice>>,
}

impl VerbsProvider {
    /// Discover NICs under `sysfs_root` (normally `/sys`), choose them by `policy` (allow-list,
    /// the pod's VFs, GID index override, NUMA node first; see `select`) and open every one
    /// that libibverbs also lists. What the choice left out is logged as warnings. Fails with
    /// `Selection` when the policy leaves no NIC, `NoDevice` when none can be opened.
    pub fn discover(sysfs_root: &Path, policy: &NicPolicy) -> Result<VerbsProvider, RdmaError> {
        let names = verbs::device_names();
        if names.is_empty() {
            return Err(RdmaError::NoDevice);
        }
        let scanned = topology::scan(sysfs_root).map_err(|e| RdmaError::Verbs {
            device: "*".into(),
            call: "sysfs scan",
            source: std::io::Error::other(e.to_string()),
        })?;
        let selection = select::select(&scanned, policy).map_err(RdmaError::Selection)?;
        for note in &selection.notes {
            tracing::warn!("RDMA NIC selection: {note}");
        }
        let mut devices: Vec<Arc<dyn RdmaDevice>> = Vec::new();
        for nic in selection
            .nics
            .into_iter()
            .filter(|n| names.contains(&n.device))
        {
            match verbs::Device::open(&nic.device) {
                Ok(dev) => devices.push(Arc::new(VerbsNic {
                    name: nic.device.clone(),
                    dev,
                    port: nic.port,
                    gid_index: nic.gid_index,
                    numa_node: nic.numa_node,
                })),
                Err(e) => {
                    tracing::warn!(device = %nic.device, error = %e, "cannot open RDMA device")
                }
            }
        }
        if devices.is_empty() {
            return Err(RdmaError::NoDevice);
        }
        Ok(VerbsProvider { devices })
    }
}

impl RdmaProvider for VerbsProvider {
    fn devices(&self) -> Vec<Arc<dyn RdmaDevice>> {
        self.devices.clone()
    }
}

fn verbs_err(device: &str, call: &'static str, e: VerbsError) -> RdmaError {
    RdmaError::Verbs {
        device: device.to_owned(),
        call,
        source: std::io::Error::other(e),
    }
}

struct VerbsNic {
    name: String,
    dev: Arc<verbs::Device>,
    port: u8,
    gid_index: u32,
    numa_node: Option<u32>,
}

impl RdmaDevice for VerbsNic {
    fn name(&self) -> &str {
        &self.name
    }

    fn numa_node(&self) -> Option<u32> {
        self.numa_node
    }

    fn port_num(&self) -> u8 {
        self.port
    }

    fn port(&self) -> Result<PortAttr, RdmaError> {
        self.dev
            .port_attr(self.port, self.gid_index)
            .map_err(|e| verbs_err(&self.name, "ibv_query_port", e))
    }

    fn register(&self, segment: &Arc<Segment>) -> Result<Arc<dyn MemoryKeys>, RdmaError> {
        let mr = verbs::MemoryRegion::register(&self.dev, segment.clone())
            .map_err(|e| verbs_err(&self.name, "ibv_reg_mr", e))?;
        Ok(Arc::new(mr))
    }

    fn create_qp(&self) -> Result<Arc<dyn QueuePairOps>, RdmaError> {
        let qp = verbs::QueuePair::create(&self.dev, self.port, self.gid_index)
            .map_err(|e| verbs_err(&self.name, "ibv_create_qp", e))?;
        let psn = rand::random::<u32>() & 0x00ff_ffff;
        let ep = qp
            .endpoint(psn)
            .map_err(|e| verbs_err(&self.name, "ibv_query_port", e))?;
        let port = self.port()?;
        Ok(Arc::new(VerbsQp {
            port,
            info: QpInfo {
                device: self.name.clone(),
                qp_num: ep.qp_num,
                psn,
                lid: ep.lid,
                gid: ep.gid,
                mtu: MTU_1024,
            },
            qp,
        }))
    }
}

impl MemoryKeys for verbs::MemoryRegion {
    fn lkey(&self) -> u32 {
        verbs::MemoryRegion::lkey(self)
    }
    fn rkey(&self) -> u32 {
        verbs::MemoryRegion::rkey(self)
    }
    fn addr(&self) -> u64 {
        verbs::MemoryRegion::addr(self)
    }
    fn size(&self) -> u64 {
        verbs::MemoryRegion::len(self)
    }
}

struct VerbsQp {
    info: QpInfo,
    /// The local port (link layer, LID, source GID) the peer is addressed from.
    port: PortAttr,
    qp: verbs::QueuePair,
}

impl QueuePairOps for VerbsQp {
    fn info(&self) -> QpInfo {
        self.info.clone()
    }

    fn connect(&self, remote: &QpInfo) -> Result<(), RdmaError> {
        let ep = verbs::QpEndpoint {
            qp_num: remote.qp_num,
            psn: remote.psn,
            lid: remote.lid,
            gid: remote.gid,
        };
        let av = address::address_for(&self.port, remote).map_err(|source| RdmaError::Address {
            device: self.info.device.clone(),
            source,
        })?;
        self.qp
            .connect(&ep, &av, self.info.psn, self.info.mtu.min(remote.mtu))
            .map_err(|e| verbs_err(&self.info.device, "ibv_modify_qp", e))
    }

    fn post(&self, wr: &WorkRequest) -> Result<(), RdmaError> {
        let op = match wr.op {
            RdmaOp::Write => verbs::RdmaOp::Write,
            RdmaOp::Read => verbs::RdmaOp::Read,
        };
        let remote = verbs::RemoteAddr {
            addr: wr.remote_addr,
            rkey: wr.rkey,
        };
        self.qp
            .post_raw(op, wr.local_addr, wr.lkey, wr.len, remote, wr.wr_id)
            .map_err(|e| verbs_err(&self.info.device, "ibv_post_send", e))
    }

    fn poll(&self, max: usize, out: &mut Vec<WorkCompletion>) -> Result<(), RdmaError> {
        let got = self
            .qp
            .poll(max)
            .map_err(|e| verbs_err(&self.info.device, "ibv_poll_cq", e))?;
        out.extend(got.into_iter().map(|(wr_id, r)| WorkCompletion {
            wr_id,
            result: r.map_err(|e| e.to_string()),
        }));
        Ok(())
    }
}
