//! The naming rules that tie a master segment to its transfer-engine registration, and the
//! transfer endpoints a replica announces. Pure.

use std::net::SocketAddr;

use super::error::DataError;
use kvpool_core::master::types::ReplicaInfo;
use kvpool_transfer::{Endpoint, MemoryKind, SegmentDescriptor};

/// Name under which an agent registers the segment `segment` of `node` with its transfer
/// engine; the master only knows `(node, segment)`, so both sides derive it the same way.
pub fn transfer_name(node: &str, segment: &str) -> String {
    format!("{node}/{segment}")
}

/// The transfer name of the segment that holds a replica.
pub(super) fn replica_name(r: &ReplicaInfo) -> String {
    transfer_name(&r.node, &r.segment)
}

/// The transfer names of several replicas, as one string for an error.
pub(super) fn replica_names<'a>(replicas: impl IntoIterator<Item = &'a ReplicaInfo>) -> String {
    replicas
        .into_iter()
        .map(replica_name)
        .collect::<Vec<_>>()
        .join(",")
}

/// Endpoint string for a TCP transfer target, as announced in a `SegmentSpec`.
pub fn tcp_endpoint(addr: SocketAddr) -> String {
    format!("tcp://{addr}")
}

/// Parse the transfer endpoints of a replica (`tcp://host:port`, `shm:///path`); unknown
/// schemes (RDMA, announced for later) are skipped.
pub fn parse_endpoints(endpoints: &[String]) -> Vec<Endpoint> {
    endpoints
        .iter()
        .filter_map(|e| {
            if let Some(rest) = e.strip_prefix("tcp://") {
                rest.parse().ok().map(Endpoint::Tcp)
            } else {
                e.strip_prefix("shm://")
                    .filter(|p| p.starts_with('/'))
                    .map(|p| Endpoint::Shm(p.into()))
            }
        })
        .collect()
}

/// The transfer-engine descriptor of a replica's segment.
pub fn descriptor(replica: &ReplicaInfo) -> Result<SegmentDescriptor, DataError> {
    let endpoints = parse_endpoints(&replica.endpoints);
    if endpoints.is_empty() {
        return Err(DataError::NoEndpoint {
            node: replica.node.clone(),
            segment: replica.segment.clone(),
            endpoints: replica.endpoints.clone(),
        });
    }
    Ok(SegmentDescriptor {
        name: replica_name(replica),
        node: replica.node.clone(),
        // Learnt from the owner when the segment is opened.
        size: 0,
        numa_node: Some(replica.numa_node),
        memory: MemoryKind::Host,
        gpu_device: None,
        endpoints,
        nics: Vec::new(),
    })
}
