//! Handler of the stats call: the pool's counters, the keys looked up (hits and misses since
//! this master started), every live node's bytes per tier and NUMA node and the Get hits it
//! served, and every node's last transport report, as
//! `kvpool` commands and tests read them. I/O boundary: none here (the state behind
//! [`Core`]).

use tonic::Status;

use super::batch::Answer;
use super::core::Core;
use crate::metrics::LookupCall;
use kvpool_core::master::state::TransportState;
use kvpool_proto::master as proto;

pub(super) async fn stats(core: &Core) -> Result<Answer<proto::StatsResponse>, Status> {
    let (s, t, nodes) = core.read(|st| (st.stats(), st.transports(), st.node_reports()))?;
    let (lookup_hits, lookup_misses) = core.metrics.lookup_totals();
    let (get_hits, get_misses) = core.metrics.lookup_call_totals(LookupCall::Get);
    Ok(Answer::plain(proto::StatsResponse {
        lookup_hits,
        lookup_misses,
        get_hits,
        get_misses,
        nodes: nodes.iter().map(Into::into).collect(),
        objects: s.objects,
        pending_puts: s.pending_puts,
        used_bytes: s.used_bytes.to_vec(),
        capacity_bytes: s.capacity_bytes.to_vec(),
        leases: s.leases,
        under_replicated: s.under_replicated,
        tasks: s.tasks,
        nodes_alive: s.nodes_alive,
        segments: s.segments,
        leader: true,
        transport: t.into_iter().map(node_transport).collect(),
    }))
}

/// Transfer engine: one node's transport state as Stats returns it.
fn node_transport((node, t): (String, TransportState)) -> proto::NodeTransport {
    proto::NodeTransport {
        node,
        report: Some(proto::TransportReport {
            rdma_requested: t.rdma_requested,
            fallback: t.fallback,
            fallback_reason: t.fallback_reason,
            rdma_devices: t.rdma_devices,
        }),
    }
}
