//! The `ShareLoad` call: the leader takes a conductor replica's report into
//! [`ConductorLoads`](crate::conductor_loads::ConductorLoads) and answers the other replicas'
//! bookings. I/O boundary: the monotonic clock.

use std::time::Instant;

use tonic::Status;

use super::batch::Answer;
use super::core::Core;
use kvpool_proto::master as proto;

/// `ShareLoad`: the leader takes the report and answers the other replicas' sum.
pub(super) async fn share_load(
    core: &Core,
    req: proto::ShareLoadRequest,
) -> Result<Answer<proto::ShareLoadResponse>, Status> {
    core.ensure_leader()?;
    let answer = core.conductors.lock().share(Instant::now(), req)?;
    Ok(Answer::plain(answer))
}
