//! Handlers of the agents' segment calls: mount, unmount, and adoption of the replicas an
//! agent still holds after a restart. I/O boundary: none here (the state behind [`Core`]).

use tonic::Status;

use super::batch::{Answer, check_batch, invalid, item_results};
use super::core::Core;
use kvpool_core::master::types::{AdoptItem, ObjectKey};
use kvpool_proto::master as proto;

pub(super) async fn mount_segment(
    core: &Core,
    req: proto::MountSegmentRequest,
) -> Result<Answer<proto::MountSegmentResponse>, Status> {
    let seg = req.segment.ok_or_else(|| invalid("segment is required"))?;
    let spec = seg
        .to_spec()
        .ok_or_else(|| invalid(format!("unknown tier {}", seg.tier)))?;
    let node = spec.node.clone();
    let id = core
        .mutate(|st| st.mount(spec))
        .await?
        .map_err(|e| proto::status_of(&e))?;
    tracing::info!(node = %node, segment = id, "segment mounted");
    Ok(Answer::plain(proto::MountSegmentResponse {
        segment_id: id,
    }))
}

pub(super) async fn unmount_segment(
    core: &Core,
    req: proto::UnmountSegmentRequest,
) -> Result<Answer<proto::Empty>, Status> {
    core.mutate(|st| st.unmount(&req.node, req.segment_id))
        .await?
        .map_err(|e| proto::status_of(&e))?;
    Ok(Answer::plain(proto::Empty {}))
}

pub(super) async fn adopt_replicas(
    core: &Core,
    req: proto::AdoptReplicasRequest,
) -> Result<Answer<proto::ItemResults>, Status> {
    check_batch(req.items.len())?;
    let items = req
        .items
        .iter()
        .enumerate()
        .map(|(i, it)| {
            let key = ObjectKey::from_hex(&it.key_digest).ok_or_else(|| {
                invalid(format!(
                    "item {i}: key digest {:?} is not 32 hex digits",
                    it.key_digest
                ))
            })?;
            Ok(AdoptItem {
                key,
                offset: it.offset,
                length: it.length,
            })
        })
        .collect::<Result<Vec<_>, Status>>()?;
    let results = core
        .mutate(|st| st.adopt(&req.node, req.segment_id, &items, req.complete))
        .await?
        .map_err(|e| proto::status_of(&e))?;
    let adopted = results.iter().filter(|r| r.is_ok()).count();
    tracing::info!(node = %req.node, segment = req.segment_id, adopted,
        refused = results.len() - adopted, "replicas adopted");
    Ok(item_results(results))
}
