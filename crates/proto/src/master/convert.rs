//! Conversions between the generated master messages and the core's types (tiers, replicas,
//! segments, tasks, errors), and the gRPC status of a core error. Pure.

use super::{Error, ErrorCode, NodeStats, NumaStats, Replica, Segment, Task, TaskKind, Tier};
use kvpool_core::master::state::MasterError;
use kvpool_core::master::state::{NodeReport, NumaUsage};
use kvpool_core::master::types as t;

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

impl From<&NumaUsage> for NumaStats {
    fn from(n: &NumaUsage) -> Self {
        NumaStats {
            unbound: n.numa_node.is_none(),
            numa_node: n.numa_node.unwrap_or(0),
            tier: Tier::from(n.tier) as i32,
            used_bytes: n.used_bytes,
            capacity_bytes: n.capacity_bytes,
        }
    }
}

impl From<&NodeReport> for NodeStats {
    fn from(r: &NodeReport) -> Self {
        NodeStats {
            node: r.node.clone(),
            used_bytes: r.used_bytes.to_vec(),
            capacity_bytes: r.capacity_bytes.to_vec(),
            numa: r.numa.iter().map(Into::into).collect(),
            get_hits: r.get_hits.to_vec(),
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
            persistent: s.persistent,
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
            persistent: self.persistent,
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
            MasterError::NoSegments => ErrorCode::NoSegments,
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
        ErrorCode::NoSegments => tonic::Status::unavailable(msg),
        ErrorCode::Persist | ErrorCode::Unspecified => tonic::Status::internal(msg),
    }
}
