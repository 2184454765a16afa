//! Target side of RDMA_CONNECT: queue pairs on the local devices that serve the segment (those
//! on its NUMA node, the NICs its descriptor lists) connected to the initiator's, and the
//! segment registered on each device used; both kept alive while the control connection stays
//! open. I/O boundary: the calls through the verbs traits.

use std::collections::HashMap;
use std::sync::Arc;

use super::{MemoryKeys, QueuePairOps, RdmaDevice, RdmaError, RdmaProvider};
use crate::descriptor::NicDescriptor;
use crate::memory::Segment;
use crate::rdma::handshake::{ConnectReply, ConnectRequest, RegionInfo};
use crate::rdma::select;

/// The devices of `devices` that serve memory on NUMA node `numa`: those on that node, or all
/// of them when it is unknown or has none (`select::local_nics`), in the provider's order.
fn serving(devices: &[Arc<dyn RdmaDevice>], numa: Option<u32>) -> Vec<usize> {
    let nodes: Vec<Option<u32>> = devices.iter().map(|d| d.numa_node()).collect();
    select::local_nics(&nodes, numa)
}

/// The NICs of `provider` that serve a segment on NUMA node `numa`, as its descriptor lists
/// them. A device whose port cannot be queried is left out (and logged).
pub(crate) fn segment_nics(provider: &dyn RdmaProvider, numa: Option<u32>) -> Vec<NicDescriptor> {
    let devices = provider.devices();
    serving(&devices, numa)
        .into_iter()
        .filter_map(|i| {
            let d = devices.get(i)?;
            match d.port() {
                Ok(attr) => Some(NicDescriptor {
                    device: d.name().to_owned(),
                    port: d.port_num(),
                    gid_index: attr.gid_index,
                    numa_node: d.numa_node(),
                }),
                Err(e) => {
                    tracing::warn!(device = d.name(), error = %e,
                        "RDMA port query failed; NIC left out of the segment's descriptor");
                    None
                }
            }
        })
        .collect()
}

/// What the target keeps alive for one accepted handshake: its queue pairs and registrations.
pub(crate) struct AcceptedPaths {
    _qps: Vec<Arc<dyn QueuePairOps>>,
    _regions: Vec<Arc<dyn MemoryKeys>>,
}

/// Target side of RDMA_CONNECT: one queue pair per requested path, round robin over the local
/// devices that serve the segment (on its NUMA node when it has NICs there, see
/// [`segment_nics`]), connected to the initiator's, and the segment registered on each device
/// used.
pub(crate) fn accept(
    provider: &dyn RdmaProvider,
    segment: &Arc<Segment>,
    req: &ConnectRequest,
) -> Result<(ConnectReply, AcceptedPaths), RdmaError> {
    let devices = provider.devices();
    let local = serving(&devices, segment.numa_node());
    if local.is_empty() {
        return Err(RdmaError::NoDevice);
    }
    let mut regions: HashMap<usize, Arc<dyn MemoryKeys>> = HashMap::new();
    let mut qps = Vec::with_capacity(req.qps.len());
    let mut paths = Vec::with_capacity(req.qps.len());
    for (i, remote) in req.qps.iter().enumerate() {
        let Some(&d) = local.get(i % local.len()) else {
            return Err(RdmaError::NoDevice);
        };
        let Some(dev) = devices.get(d) else {
            return Err(RdmaError::NoDevice);
        };
        let mr = match regions.get(&d) {
            Some(mr) => mr.clone(),
            None => {
                let mr = dev.register(segment)?;
                regions.insert(d, mr.clone());
                mr
            }
        };
        let qp = dev.create_qp()?;
        qp.connect(remote)?;
        paths.push((
            qp.info(),
            RegionInfo {
                addr: mr.addr(),
                rkey: mr.rkey(),
                len: mr.size(),
            },
        ));
        qps.push(qp);
    }
    Ok((
        ConnectReply { paths },
        AcceptedPaths {
            _qps: qps,
            _regions: regions.into_values().collect(),
        },
    ))
}
