//! Handler of the agents' task reports: a repair or demotion task the master handed out in a
//! heartbeat is done (or failed). I/O boundary: none here (the state behind [`Core`]).

use tonic::Status;

use super::batch::Answer;
use super::core::Core;
use kvpool_proto::master as proto;

pub(super) async fn complete_task(
    core: &Core,
    req: proto::CompleteTaskRequest,
) -> Result<Answer<proto::Empty>, Status> {
    core.mutate(|st| st.complete_task(&req.node, req.task_id, req.ok))
        .await?
        .map_err(|e| proto::status_of(&e))?;
    Ok(Answer::plain(proto::Empty {}))
}
