//! Generated gRPC types of `proto/master/master.proto` and conversions to and from the core's
//! types. Pure; the wire boundary is in `service` and `client`.

#![allow(clippy::all, missing_docs)]

tonic::include_proto!("kvpool.master.v1");

use kvpool_core::master::state::MasterError;
use kvpool_core::master::types as t;

/// Metadata header naming the leader's gRPC address on UNAVAILABLE answers from a standby.
pub const LEADER_HEADER: &str = "x-kvpool-leader";
/// Most items accepted in one batched call.
pub const MAX_BATCH: usize = 16_384;
/// Longest accepted key.
pub const MAX_KEY_BYTES: usize = 4096;

impl From<t::Tier> for Tier {
    fn from(v: t::Tier) -> Self {
        match v {
            t::Tier::Dram => Tier::Dram,
            t::Tier::Ssd => Tier::Ssd,
        }
    }
}

impl From<Tier> for t::Tier {
    fn from(v: Tier) -> Self {
        match v {
            Tier::Dram => t::Tier::Dram,
            Tier::Ssd => t::Tier::Ssd,
        }
    }
}

/// Tier from its wire number; unknown numbers are refused.
pub fn tier_from_i32(v: i32) -> Option<t::Tier> {
    Tier::try_from(v).ok().map(Into::into)
}

impl From<&t::ReplicaInfo> for Replica {
    fn from(r: &t::ReplicaInfo) -> Self {
        Replica {
            node: r.node.clone(),
            segment_id: r.segment_id,
            segment: r.segment.clone(),
            tier: Tier::from(r.tier) as i32,
            numa_node: r.numa_node,
            endpoints: r.endpoints.clone(),
            offset: r.offset,
            length: r.length,
        }
    }
}

impl Replica {
    /// Core view; `None` when the tier number is unknown.
    pub fn to_info(&self) -> Option<t::ReplicaInfo> {
        Some(t::ReplicaInfo {
            node: self.node.clone(),
            segment_id: self.segment_id,
            segment: self.segment.clone(),
            tier: tier_from_i32(self.tier)?,
            numa_node: self.numa_node,
            endpoints: self.endpoints.clone(),
            offset: self.offset,
            length: self.length,
        })
    }
}

impl From<&t::SegmentSpec> for Segment {
    fn from(s: &t::SegmentSpec) -> Self {
        Segment {
            node: s.node.clone(),
            name: s.name.clone(),
            tier: Tier::from(s.tier) as i32,
            capacity_bytes: s.capacity_bytes,
            numa_node: s.numa_node,
            failure_domain: s.failure_domain.clone(),
            endpoints: s.endpoints.clone(),
        }
    }
}

impl Segment {
    pub fn to_spec(&self) -> Option<t::SegmentSpec> {
        Some(t::SegmentSpec {
            node: self.node.clone(),
            name: self.name.clone(),
            tier: tier_from_i32(self.tier)?,
            capacity_bytes: self.capacity_bytes,
            numa_node: self.numa_node,
            failure_domain: self.failure_domain.clone(),
            endpoints: self.endpoints.clone(),
        })
    }
}

impl From<&t::Task> for Task {
    fn from(task: &t::Task) -> Self {
        Task {
            id: task.id,
            kind: match task.kind {
                t::TaskKind::Repair => TaskKind::Repair,
                t::TaskKind::Demote => TaskKind::Demote,
            } as i32,
            key_digest: task.key.to_hex(),
            source: Some((&task.source).into()),
            target: Some((&task.target).into()),
        }
    }
}

impl Task {
    pub fn to_task(&self) -> Option<t::Task> {
        Some(t::Task {
            id: self.id,
            kind: match TaskKind::try_from(self.kind).ok()? {
                TaskKind::Repair => t::TaskKind::Repair,
                TaskKind::Demote => t::TaskKind::Demote,
            },
            key: t::ObjectKey::from_hex(&self.key_digest)?,
            source: self.source.as_ref()?.to_info()?,
            target: self.target.as_ref()?.to_info()?,
        })
    }
}

impl From<&MasterError> for ErrorCode {
    fn from(e: &MasterError) -> Self {
        match e {
            MasterError::UnknownKey(_) => ErrorCode::UnknownKey,
            MasterError::PutInProgress(_) => ErrorCode::PutInProgress,
            MasterError::SizeConflict { .. } => ErrorCode::SizeConflict,
            MasterError::TooLarge { .. } => ErrorCode::TooLarge,
            MasterError::NoSpace { .. } => ErrorCode::NoSpace,
            MasterError::InvalidArgument(_) => ErrorCode::InvalidArgument,
            MasterError::StalePut { .. } => ErrorCode::StalePut,
            MasterError::StaleLease(_) => ErrorCode::StaleLease,
            MasterError::Leased { .. } => ErrorCode::Leased,
            MasterError::LeaseLimit(_) => ErrorCode::LeaseLimit,
            MasterError::UnknownNode(_) => ErrorCode::UnknownNode,
            MasterError::UnknownSegment { .. } => ErrorCode::UnknownSegment,
            MasterError::UnknownTask(_) => ErrorCode::UnknownTask,
            MasterError::ReplicasLost(_) => ErrorCode::ReplicasLost,
        }
    }
}

impl From<&MasterError> for Error {
    fn from(e: &MasterError) -> Self {
        Error {
            code: ErrorCode::from(e) as i32,
            message: e.to_string(),
        }
    }
}

/// gRPC status for a core error on a non-batched call.
pub fn status_of(e: &MasterError) -> tonic::Status {
    let msg = e.to_string();
    match ErrorCode::from(e) {
        ErrorCode::UnknownKey
        | ErrorCode::UnknownNode
        | ErrorCode::UnknownSegment
        | ErrorCode::UnknownTask => tonic::Status::not_found(msg),
        ErrorCode::PutInProgress | ErrorCode::SizeConflict => tonic::Status::already_exists(msg),
        ErrorCode::NoSpace | ErrorCode::LeaseLimit => tonic::Status::resource_exhausted(msg),
        ErrorCode::TooLarge | ErrorCode::InvalidArgument => tonic::Status::invalid_argument(msg),
        ErrorCode::StalePut | ErrorCode::StaleLease | ErrorCode::Leased => {
            tonic::Status::failed_precondition(msg)
        }
        ErrorCode::ReplicasLost => tonic::Status::aborted(msg),
        ErrorCode::Persist | ErrorCode::Unspecified => tonic::Status::internal(msg),
    }
}

/// Conversions of the segment-event feed (agent, issue 4) between the core and the wire.
pub mod feed {
    use tonic::Status;

    use super as proto;
    use kvpool_core::master::ObjectKey;
    use kvpool_core::master::state::{CorruptBlock, SegmentEvent, SegmentEventKind};

    /// The corrupt-block reports of a heartbeat; a malformed digest fails the call.
    pub fn corrupt_blocks(items: &[proto::SegmentBlock]) -> Result<Vec<CorruptBlock>, Status> {
        items
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let key = ObjectKey::from_hex(&b.key_digest).ok_or_else(|| {
                    Status::invalid_argument(format!(
                        "corrupt block {i}: key digest {:?} is not 32 hex digits",
                        b.key_digest
                    ))
                })?;
                Ok(CorruptBlock {
                    segment_id: b.segment_id,
                    key,
                    offset: b.offset,
                })
            })
            .collect()
    }

    pub fn kind_to_proto(k: SegmentEventKind) -> proto::SegmentEventKind {
        match k {
            SegmentEventKind::Commit => proto::SegmentEventKind::Commit,
            SegmentEventKind::Free => proto::SegmentEventKind::Free,
            SegmentEventKind::Reset => proto::SegmentEventKind::Reset,
            SegmentEventKind::ResetDone => proto::SegmentEventKind::ResetDone,
        }
    }

    pub fn event_to_proto(e: &SegmentEvent) -> proto::SegmentEvent {
        let boundary = matches!(
            e.kind,
            SegmentEventKind::Reset | SegmentEventKind::ResetDone
        );
        proto::SegmentEvent {
            seq: e.seq,
            kind: kind_to_proto(e.kind) as i32,
            segment_id: e.segment_id,
            key_digest: if boundary {
                String::new()
            } else {
                e.key.to_hex()
            },
            offset: e.offset,
            length: e.length,
        }
    }

    /// Decode an event from the wire; `None` when its kind or digest is not understood.
    pub fn event_from_proto(e: &proto::SegmentEvent) -> Option<SegmentEvent> {
        let kind = match proto::SegmentEventKind::try_from(e.kind).ok()? {
            proto::SegmentEventKind::Commit => SegmentEventKind::Commit,
            proto::SegmentEventKind::Free => SegmentEventKind::Free,
            proto::SegmentEventKind::Reset => SegmentEventKind::Reset,
            proto::SegmentEventKind::ResetDone => SegmentEventKind::ResetDone,
        };
        let key = match kind {
            SegmentEventKind::Reset | SegmentEventKind::ResetDone => ObjectKey { hi: 0, lo: 0 },
            _ => ObjectKey::from_hex(&e.key_digest)?,
        };
        Some(SegmentEvent {
            seq: e.seq,
            kind,
            segment_id: e.segment_id,
            key,
            offset: e.offset,
            length: e.length,
        })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn events_round_trip_and_bad_input_is_refused() {
            for kind in [
                SegmentEventKind::Commit,
                SegmentEventKind::Free,
                SegmentEventKind::Reset,
                SegmentEventKind::ResetDone,
            ] {
                let boundary =
                    matches!(kind, SegmentEventKind::Reset | SegmentEventKind::ResetDone);
                let e = SegmentEvent {
                    seq: 7,
                    kind,
                    segment_id: 3,
                    key: if boundary {
                        ObjectKey { hi: 0, lo: 0 }
                    } else {
                        ObjectKey::from_bytes(b"k")
                    },
                    offset: 8192,
                    length: 100,
                };
                assert_eq!(event_from_proto(&event_to_proto(&e)), Some(e));
            }
            let mut bad = event_to_proto(&SegmentEvent {
                seq: 1,
                kind: SegmentEventKind::Free,
                segment_id: 1,
                key: ObjectKey::from_bytes(b"k"),
                offset: 0,
                length: 0,
            });
            bad.kind = 99;
            assert_eq!(event_from_proto(&bad), None);
            bad.kind = proto::SegmentEventKind::Commit as i32;
            bad.key_digest = "zz".into();
            assert_eq!(event_from_proto(&bad), None);
            let e = corrupt_blocks(&[proto::SegmentBlock {
                segment_id: 1,
                key_digest: "nothex".into(),
                offset: 0,
            }])
            .expect_err("bad digest");
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
        }
    }
}
