//! The calls node agents make: mounting segments, heartbeats (with the transport report and the
//! segment-event feed), task completion and replica adoption after a restart. I/O boundary:
//! the master's gRPC channel, through [`MasterClient::call`].

use super::MasterClient;
use super::answers::item_results;
use super::error::ClientError;
use kvpool_core::master::state::{CorruptBlock, HeartbeatReply};
use kvpool_core::master::types::{AdoptItem, SegmentSpec, Task};
use kvpool_proto::master::{self as proto, feed};

impl MasterClient {
    pub async fn mount_segment(&self, spec: &SegmentSpec) -> Result<u32, ClientError> {
        let req = proto::MountSegmentRequest {
            segment: Some(spec.into()),
        };
        Ok(rpc!(self, mount_segment, req)?.segment_id)
    }

    pub async fn unmount_segment(&self, node: &str, segment_id: u32) -> Result<(), ClientError> {
        let req = proto::UnmountSegmentRequest {
            node: node.to_owned(),
            segment_id,
        };
        rpc!(self, unmount_segment, req)?;
        Ok(())
    }

    /// Heartbeat; returns the tasks the master queued for this node.
    pub async fn heartbeat(&self, node: &str) -> Result<Vec<Task>, ClientError> {
        self.heartbeat_with_transport(node, None).await
    }

    /// Heartbeat that also reports this node's transfer-engine transport state (the master
    /// keeps the last one per node and returns it in `Stats`).
    pub async fn heartbeat_with_transport(
        &self,
        node: &str,
        transport: Option<proto::TransportReport>,
    ) -> Result<Vec<Task>, ClientError> {
        let req = proto::HeartbeatRequest {
            node: node.to_owned(),
            transport,
            ..Default::default()
        };
        tasks_of(&rpc!(self, heartbeat, req)?)
    }

    /// Heartbeat with the segment-event feed (agent, issue 4): acknowledges the events applied
    /// up to `acked` under `epoch` and reports corrupt blocks; returns the queued tasks, the
    /// master's feed epoch and the pending events.
    pub async fn heartbeat_feed(
        &self,
        node: &str,
        epoch: u64,
        acked: u64,
        corrupt: &[CorruptBlock],
        transport: Option<proto::TransportReport>,
    ) -> Result<HeartbeatReply, ClientError> {
        let req = proto::HeartbeatRequest {
            node: node.to_owned(),
            feed_epoch: epoch,
            feed_acked: acked,
            corrupt: corrupt
                .iter()
                .map(|c| proto::SegmentBlock {
                    segment_id: c.segment_id,
                    key_digest: c.key.to_hex(),
                    offset: c.offset,
                })
                .collect(),
            transport,
        };
        let r = rpc!(self, heartbeat, req)?;
        let tasks = tasks_of(&r)?;
        let events = r
            .events
            .iter()
            .map(|e| {
                feed::event_from_proto(e)
                    .ok_or_else(|| ClientError::Malformed(format!("segment event {}", e.seq)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(HeartbeatReply {
            tasks,
            feed_epoch: r.feed_epoch,
            events,
        })
    }

    pub async fn complete_task(
        &self,
        node: &str,
        task_id: u64,
        ok: bool,
    ) -> Result<(), ClientError> {
        let req = proto::CompleteTaskRequest {
            node: node.to_owned(),
            task_id,
            ok,
        };
        rpc!(self, complete_task, req)?;
        Ok(())
    }

    /// Announce replicas this node holds in its mounted segment `segment_id` (after a
    /// restart); one result per item, in order. `complete`: this is the last batch, and a
    /// segment mounted persistent may take new replicas from now on.
    pub async fn adopt_replicas(
        &self,
        node: &str,
        segment_id: u32,
        items: &[AdoptItem],
        complete: bool,
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        let req = proto::AdoptReplicasRequest {
            node: node.to_owned(),
            segment_id,
            complete,
            items: items
                .iter()
                .map(|i| proto::AdoptItem {
                    key_digest: i.key.to_hex(),
                    offset: i.offset,
                    length: i.length,
                })
                .collect(),
        };
        item_results(rpc!(self, adopt_replicas, req)?, items.len())
    }
}

/// The tasks of a heartbeat answer; a malformed one fails the call.
fn tasks_of(r: &proto::HeartbeatResponse) -> Result<Vec<Task>, ClientError> {
    r.tasks
        .iter()
        .map(|t| {
            t.to_task()
                .ok_or_else(|| ClientError::Malformed(format!("task {}", t.id)))
        })
        .collect()
}
