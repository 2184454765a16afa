//! Handler of the agents' heartbeat: liveness, the segment-event feed (acknowledged events,
//! corrupt blocks reported, pending events returned), the node's transfer-engine transport
//! report, and the tasks queued for the node. I/O boundary: none here (the state behind
//! [`Core`]).

use tonic::Status;

use super::batch::Answer;
use super::core::Core;
use kvpool_core::master::state::{MasterError, TransportState};
use kvpool_proto::master::{self as proto, feed};

/// Longest fallback reason kept per node, in characters.
const MAX_TRANSPORT_REASON: usize = 512;
/// Most RDMA device names kept per node, and the longest name.
const MAX_TRANSPORT_DEVICES: usize = 16;
const MAX_DEVICE_NAME: usize = 64;

pub(super) async fn heartbeat(
    core: &Core,
    req: proto::HeartbeatRequest,
) -> Result<Answer<proto::HeartbeatResponse>, Status> {
    let transport = req.transport.as_ref().map(transport_state);
    let corrupt = feed::corrupt_blocks(&req.corrupt)?;
    let reply = core
        .mutate(|st| {
            let reply = st.heartbeat_feed(&req.node, req.feed_epoch, req.feed_acked, &corrupt)?;
            if let Some(t) = transport {
                st.record_transport(&req.node, t)?;
            }
            Ok::<_, MasterError>(reply)
        })
        .await?
        .map_err(|e| proto::status_of(&e))?;
    Ok(Answer::plain(proto::HeartbeatResponse {
        tasks: reply.tasks.iter().map(Into::into).collect(),
        feed_epoch: reply.feed_epoch,
        events: reply.events.iter().map(feed::event_to_proto).collect(),
    }))
}

/// Transfer engine: a heartbeat's transport report as the state keeps it, cut to bounded sizes
/// (it comes from the network and is kept per node).
fn transport_state(r: &proto::TransportReport) -> TransportState {
    let cut = |s: &str, n: usize| s.chars().take(n).collect::<String>();
    TransportState {
        rdma_requested: r.rdma_requested,
        fallback: r.fallback,
        fallback_reason: cut(&r.fallback_reason, MAX_TRANSPORT_REASON),
        rdma_devices: r
            .rdma_devices
            .iter()
            .take(MAX_TRANSPORT_DEVICES)
            .map(|d| cut(d, MAX_DEVICE_NAME))
            .collect(),
    }
}
