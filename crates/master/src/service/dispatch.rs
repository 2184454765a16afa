//! The tonic service trait of the master: each call hands its request to its handler (in
//! `segments`, `heartbeat`, `tasks`, `objects`, `admin`) and records the call's duration and
//! outcome in the metrics. I/O boundary: none here; the listener is in `serve`.

use std::time::Instant;

use tonic::{Request, Response, Status};

use super::MasterSvc;
use super::batch::Answer;
use super::{admin, conductors, heartbeat, objects, segments, tasks};
use kvpool_proto::auth::Verified;
use kvpool_proto::master as proto;

/// A node call's check (see [`Verified::may_act_for`]): the caller's credential, which the
/// interceptor checked and left in the request's extensions, may act for `node`.
fn acting_for<T>(req: &Request<T>, node: &str) -> Result<(), Status> {
    let verified = req
        .extensions()
        .get::<Verified>()
        .ok_or_else(|| Status::internal("the call's credential was not checked"))?;
    verified.may_act_for(node).map_err(|e| {
        tracing::debug!(node, error = %e, "node call refused");
        Status::permission_denied(e)
    })
}

/// Metric label for a call's outcome.
fn outcome<T>(r: &Result<Response<T>, Status>, first_item_error: Option<&'static str>) -> String {
    match r {
        Err(s) => format!("{:?}", s.code()).to_lowercase(),
        Ok(_) => first_item_error.unwrap_or("ok").to_owned(),
    }
}

impl MasterSvc {
    /// Run a handler as the call `method`, recording its duration and outcome.
    async fn observed<T>(
        &self,
        method: &str,
        handler: impl Future<Output = Result<Answer<T>, Status>>,
    ) -> Result<Response<T>, Status> {
        let start = Instant::now();
        let answer = handler.await;
        let item_error = answer.as_ref().ok().and_then(|a| a.item_error);
        let r = answer.map(|a| Response::new(a.message));
        self.core.metrics.observe_call(
            method,
            &outcome(&r, item_error),
            start.elapsed().as_secs_f64(),
        );
        r
    }
}

#[tonic::async_trait]
impl proto::master_server::Master for MasterSvc {
    async fn mount_segment(
        &self,
        req: Request<proto::MountSegmentRequest>,
    ) -> Result<Response<proto::MountSegmentResponse>, Status> {
        let allowed = acting_for(
            &req,
            req.get_ref()
                .segment
                .as_ref()
                .map_or("", |s| s.node.as_str()),
        );
        let handler = async {
            allowed?;
            segments::mount_segment(&self.core, req.into_inner()).await
        };
        self.observed("mount_segment", handler).await
    }

    async fn unmount_segment(
        &self,
        req: Request<proto::UnmountSegmentRequest>,
    ) -> Result<Response<proto::Empty>, Status> {
        let allowed = acting_for(&req, &req.get_ref().node);
        let handler = async {
            allowed?;
            segments::unmount_segment(&self.core, req.into_inner()).await
        };
        self.observed("unmount_segment", handler).await
    }

    async fn heartbeat(
        &self,
        req: Request<proto::HeartbeatRequest>,
    ) -> Result<Response<proto::HeartbeatResponse>, Status> {
        let allowed = acting_for(&req, &req.get_ref().node);
        let handler = async {
            allowed?;
            heartbeat::heartbeat(&self.core, req.into_inner()).await
        };
        self.observed("heartbeat", handler).await
    }

    async fn complete_task(
        &self,
        req: Request<proto::CompleteTaskRequest>,
    ) -> Result<Response<proto::Empty>, Status> {
        let allowed = acting_for(&req, &req.get_ref().node);
        let handler = async {
            allowed?;
            tasks::complete_task(&self.core, req.into_inner()).await
        };
        self.observed("complete_task", handler).await
    }

    async fn adopt_replicas(
        &self,
        req: Request<proto::AdoptReplicasRequest>,
    ) -> Result<Response<proto::ItemResults>, Status> {
        let allowed = acting_for(&req, &req.get_ref().node);
        let handler = async {
            allowed?;
            segments::adopt_replicas(&self.core, req.into_inner()).await
        };
        self.observed("adopt_replicas", handler).await
    }

    async fn put_start(
        &self,
        req: Request<proto::PutStartRequest>,
    ) -> Result<Response<proto::PutStartResponse>, Status> {
        let handler = objects::put_start(&self.core, req.into_inner());
        self.observed("put_start", handler).await
    }

    async fn put_end(
        &self,
        req: Request<proto::PutEndRequest>,
    ) -> Result<Response<proto::ItemResults>, Status> {
        let handler = objects::put_end(&self.core, req.into_inner());
        self.observed("put_end", handler).await
    }

    async fn put_revoke(
        &self,
        req: Request<proto::PutEndRequest>,
    ) -> Result<Response<proto::ItemResults>, Status> {
        let handler = objects::put_revoke(&self.core, req.into_inner());
        self.observed("put_revoke", handler).await
    }

    async fn get(
        &self,
        req: Request<proto::KeysRequest>,
    ) -> Result<Response<proto::GetResponse>, Status> {
        let handler = objects::get(&self.core, req.into_inner());
        self.observed("get", handler).await
    }

    async fn release_leases(
        &self,
        req: Request<proto::ReleaseLeasesRequest>,
    ) -> Result<Response<proto::ItemResults>, Status> {
        let handler = objects::release_leases(&self.core, req.into_inner());
        self.observed("release_leases", handler).await
    }

    async fn exists(
        &self,
        req: Request<proto::KeysRequest>,
    ) -> Result<Response<proto::ExistsResponse>, Status> {
        let handler = objects::exists(&self.core, req.into_inner());
        self.observed("exists", handler).await
    }

    async fn longest_prefix(
        &self,
        req: Request<proto::KeysRequest>,
    ) -> Result<Response<proto::LongestPrefixResponse>, Status> {
        let handler = objects::longest_prefix(&self.core, req.into_inner());
        self.observed("longest_prefix", handler).await
    }

    async fn remove(
        &self,
        req: Request<proto::KeysRequest>,
    ) -> Result<Response<proto::ItemResults>, Status> {
        let handler = objects::remove(&self.core, req.into_inner());
        self.observed("remove", handler).await
    }

    async fn remove_all(
        &self,
        _req: Request<proto::Empty>,
    ) -> Result<Response<proto::RemoveAllResponse>, Status> {
        let handler = objects::remove_all(&self.core);
        self.observed("remove_all", handler).await
    }

    async fn pin(
        &self,
        req: Request<proto::PinRequest>,
    ) -> Result<Response<proto::ItemResults>, Status> {
        let handler = objects::pin(&self.core, req.into_inner());
        self.observed("pin", handler).await
    }

    async fn unpin(
        &self,
        req: Request<proto::KeysRequest>,
    ) -> Result<Response<proto::ItemResults>, Status> {
        let handler = objects::unpin(&self.core, req.into_inner());
        self.observed("unpin", handler).await
    }

    async fn stats(
        &self,
        _req: Request<proto::Empty>,
    ) -> Result<Response<proto::StatsResponse>, Status> {
        let handler = admin::stats(&self.core);
        self.observed("stats", handler).await
    }

    async fn share_load(
        &self,
        req: Request<proto::ShareLoadRequest>,
    ) -> Result<Response<proto::ShareLoadResponse>, Status> {
        let handler = conductors::share_load(&self.core, req.into_inner());
        self.observed("share_load", handler).await
    }

    async fn replicate_hot(
        &self,
        req: Request<proto::ReplicateHotRequest>,
    ) -> Result<Response<proto::ItemResults>, Status> {
        let handler = objects::replicate_hot(&self.core, req.into_inner());
        self.observed("replicate_hot", handler).await
    }
}
