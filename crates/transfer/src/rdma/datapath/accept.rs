//! Target side of RDMA_CONNECT: queue pairs on the local devices connected to the initiator's,
//! and the segment registered on each device used; both kept alive while the control
//! connection stays open. I/O boundary: the calls through the verbs traits.

use std::collections::HashMap;
use std::sync::Arc;

use super::{MemoryKeys, QueuePairOps, RdmaError, RdmaProvider};
use crate::memory::Segment;
use crate::rdma::handshake::{ConnectReply, ConnectRequest, RegionInfo};

/// What the target keeps alive for one accepted handshake: its queue pairs and registrations.
pub(crate) struct AcceptedPaths {
    _qps: Vec<Arc<dyn QueuePairOps>>,
    _regions: Vec<Arc<dyn MemoryKeys>>,
}

/// Target side of RDMA_CONNECT: one queue pair per requested path (on the local devices, round
/// robin), connected to the initiator's, and the segment registered on each device used.
pub(crate) fn accept(
    provider: &dyn RdmaProvider,
    segment: &Arc<Segment>,
    req: &ConnectRequest,
) -> Result<(ConnectReply, AcceptedPaths), RdmaError> {
    let devices = provider.devices();
    if devices.is_empty() {
        return Err(RdmaError::NoDevice);
    }
    let mut regions: HashMap<usize, Arc<dyn MemoryKeys>> = HashMap::new();
    let mut qps = Vec::with_capacity(req.qps.len());
    let mut paths = Vec::with_capacity(req.qps.len());
    for (i, remote) in req.qps.iter().enumerate() {
        let d = i % devices.len();
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
