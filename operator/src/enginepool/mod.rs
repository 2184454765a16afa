//! The `PrefillPool` and `DecodePool` controllers (one generic implementation): dereference the
//! KVCachePool -> validate -> build -> apply -> status. A missing KVCachePool is reported as
//! Ready=False/KVCachePoolNotFound; the controller's watch on KVCachePools maps a pool that
//! appears (or changes) back to the engine pools that reference it. A pool with
//! `spec.autoscaling` gets its instance count from `autoscale` (the conductor's load) each
//! [`AUTOSCALE_PERIOD`]. Fields of `spec.template` that the operator's own values overrode are
//! named by the `TemplateConflict` condition and, when they change, a Warning Event. Whether
//! the engine pools sharing the KVCachePool serve this pool's model together is the
//! `ModelMismatch` condition (and a Warning Event when it turns True or changes;
//! [`crate::serving`]); a mismatch blocks nothing.
//! I/O boundary: the GET of the KVCachePool, the lists of the engine pools, the conductor read,
//! the applies, the Events and the status write.

pub mod autoscale;
pub mod build;
pub mod status;
pub mod validate;

use kvpool_runtime::telemetry::chain;
use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kvpool_crd::KVCachePool;
use tracing::{info, instrument, warn};

use crate::apply;
use crate::cachepool;
use crate::conditions::{self, reason};
use crate::context::{AUTOSCALE_PERIOD, Context, RESYNC};
use crate::controller;
pub use crate::engine_kind::EnginePool;
use crate::error::{Error, Result};
use crate::labels;
use crate::serving;

/// What a reconcile did, for metrics (labelled by [`Outcome::label`]) and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum Outcome {
    #[strum(serialize = "ok")]
    Reconciled,
    /// The referenced KVCachePool does not exist (yet).
    PoolNotFound,
    /// The referenced KVCachePool is invalid.
    PoolInvalid,
    /// This object's spec is invalid.
    Invalid,
    Deleting,
}

impl Outcome {
    /// Metric label of the outcome.
    pub fn label(self) -> &'static str {
        self.into()
    }
}

fn key<K: EnginePool>(obj: &K) -> String {
    format!(
        "{}/{}/{}",
        K::KIND_NAME,
        obj.namespace().unwrap_or_default(),
        obj.name_any()
    )
}

/// Entry point for the kube runtime controller.
pub async fn reconcile<K: EnginePool>(obj: Arc<K>, ctx: Arc<Context>) -> Result<Action> {
    let pass = controller::Pass::start(&ctx, K::KIND_NAME);
    let result = reconcile_engine_pool(obj.as_ref(), &ctx).await;
    let outcome = pass.finish(&key(obj.as_ref()), result, Outcome::label)?;
    let autoscaled = obj.validated().is_ok_and(|v| v.autoscaling.is_some());
    Ok(match outcome {
        Outcome::Reconciled if autoscaled => Action::requeue(AUTOSCALE_PERIOD),
        Outcome::Reconciled => Action::requeue(RESYNC),
        // The KVCachePool watch brings these back when the pool appears or changes.
        Outcome::PoolNotFound | Outcome::PoolInvalid | Outcome::Invalid | Outcome::Deleting => {
            Action::await_change()
        }
    })
}

/// Retry policy: invalid objects wait for a change; transient failures back off per object.
pub fn error_policy<K: EnginePool>(obj: Arc<K>, err: &Error, ctx: Arc<Context>) -> Action {
    let key = key(obj.as_ref());
    let Some(delay) = controller::retry_delay(&ctx, err, &key) else {
        return Action::await_change();
    };
    warn!(object = %key, error = %chain(&err), category = err.category(), retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// The engine pools in `store` that reference `pool` (the watch mapping).
pub fn referencing<K: EnginePool>(store: &Store<K>, pool: &KVCachePool) -> Vec<ObjectRef<K>> {
    let (Some(ns), name) = (pool.namespace(), pool.name_any()) else {
        return Vec::new();
    };
    let mut refs: Vec<ObjectRef<K>> = store
        .state()
        .iter()
        .filter(|o| o.namespace().as_deref() == Some(ns.as_str()) && o.pool_ref() == name)
        .map(|o| ObjectRef::from_obj(o.as_ref()))
        .collect();
    refs.sort_by_key(|r| r.name.clone());
    refs
}

/// The engine pools in `store` that share `other`'s KVCachePool (`other` itself included when
/// it is of the same kind): their `ModelMismatch` may change with `other`.
pub fn siblings<K: EnginePool, O: EnginePool>(store: &Store<K>, other: &O) -> Vec<ObjectRef<K>> {
    let ns = other.namespace();
    let mut refs: Vec<ObjectRef<K>> = store
        .state()
        .iter()
        .filter(|o| o.namespace() == ns && o.pool_ref() == other.pool_ref())
        .map(|o| ObjectRef::from_obj(o.as_ref()))
        .collect();
    refs.sort_by_key(|r| r.name.clone());
    refs
}

async fn write_blocked<K: EnginePool>(
    ctx: &Context,
    api: &Api<K>,
    obj: &K,
    why: &'static str,
    message: &str,
) -> Result<()> {
    let status = status::blocked_status(
        obj.engine_status(),
        obj.meta().generation,
        why,
        message,
        ctx.now(),
    );
    if obj.engine_status() != Some(&status) {
        apply::patch_status(&ctx.settings.field_manager, api, &obj.name_any(), &status).await?;
    }
    Ok(())
}

/// One pass of the pipeline. Public so that tests drive it directly.
#[instrument(skip_all, fields(kind = K::KIND_NAME, name = %obj.name_any(), namespace = obj.namespace().unwrap_or_default(), pool = obj.pool_ref()))]
pub async fn reconcile_engine_pool<K: EnginePool>(obj: &K, ctx: &Context) -> Result<Outcome> {
    if obj.meta().deletion_timestamp.is_some() {
        autoscale::forget(
            ctx,
            &autoscale::state_key(
                K::KIND_NAME,
                &obj.namespace().unwrap_or_default(),
                &obj.name_any(),
            ),
        );
        return Ok(Outcome::Deleting);
    }
    let namespace = obj
        .namespace()
        .ok_or(Error::MissingObjectKey("namespace"))?;
    let name = obj
        .meta()
        .name
        .clone()
        .ok_or(Error::MissingObjectKey("name"))?;
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &namespace);

    // Dereference.
    let pool_name = obj.pool_ref().to_owned();
    let pools: Api<KVCachePool> = Api::namespaced(ctx.client.clone(), &namespace);
    let pool = pools
        .get_opt(&pool_name)
        .await
        .map_err(|source| Error::Get {
            kind: "KVCachePool",
            name: pool_name.clone(),
            source,
        })?;
    let Some(pool) = pool else {
        let message =
            format!("KVCachePool {namespace}/{pool_name} (spec.kvCachePoolRef) does not exist");
        info!(engine_pool = %name, %message, "waiting for the KVCachePool");
        write_blocked(ctx, &api, obj, reason::KVCACHEPOOL_NOT_FOUND, &message).await?;
        return Ok(Outcome::PoolNotFound);
    };
    let valid_pool = match cachepool::validate::validate(&pool, &ctx.settings) {
        Ok(v) => v,
        Err(Error::InvalidSpec(why)) => {
            let message = format!("KVCachePool {pool_name} is invalid: {why}");
            write_blocked(ctx, &api, obj, status::KVCACHEPOOL_INVALID, &message).await?;
            return Ok(Outcome::PoolInvalid);
        }
        Err(other) => return Err(other),
    };

    // Validate.
    let mut valid = match validate::validate(obj, valid_pool) {
        Ok(v) => v,
        Err(Error::InvalidSpec(message)) => {
            warn!(engine_pool = %name, %message, "invalid spec");
            controller::publish_warning(ctx, obj, reason::INVALID_SPEC, "Reconcile", &message)
                .await?;
            write_blocked(ctx, &api, obj, reason::INVALID_SPEC, &message).await?;
            return Ok(Outcome::Invalid);
        }
        Err(other) => return Err(other),
    };

    // The engine pools beside this one: whether they serve this pool's model together.
    // The check is advice: a failed list keeps the last condition instead of failing the pass.
    let mismatch = match serving::api::engine_pools(ctx, &namespace, &pool_name).await {
        Ok(engines) => {
            serving::serving(obj).map(|this| serving::engine_condition(&pool_name, &this, &engines))
        }
        Err(e) => {
            warn!(engine_pool = %name, error = %chain(&e), "cannot list the engine pools beside this one; ModelMismatch kept");
            None
        }
    };

    // Autoscale: the count the Deployment runs (spec.replicas is only the starting one).
    let scaling = match valid.effective.autoscaling {
        Some(cfg) => Some(autoscale::step(ctx, obj, &valid, cfg).await),
        None => {
            autoscale::forget(ctx, &autoscale::state_key(K::KIND_NAME, &namespace, &name));
            None
        }
    };
    if let Some(s) = &scaling {
        valid.effective.replicas = s.desired;
    }

    // Build.
    let config_hash = cachepool::build::config_hash(&cachepool::build::config_data(&valid.pool)?);
    let children = build::build(&valid, &config_hash);

    // Apply.
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), &namespace);
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), &namespace);
    let policies: Api<NetworkPolicy> = Api::namespaced(ctx.client.clone(), &namespace);
    // The policy exists before the pods it admits traffic to.
    if let Some(policy) = &children.network_policy {
        apply::apply(&ctx.settings.field_manager, &policies, policy).await?;
    }
    apply::apply(&ctx.settings.field_manager, &services, &children.service).await?;
    let applied = apply::apply_workload(
        &ctx.settings.field_manager,
        &deployments,
        &children.deployment,
    )
    .await?;
    let selector = labels::owner_selector(K::KIND_NAME, &name);
    let keep = BTreeSet::from([build::child_name(&valid)]);
    apply::delete_orphans(&deployments, &selector, &keep).await?;
    apply::delete_orphans(&services, &selector, &keep).await?;
    let keep_policy = match &children.network_policy {
        Some(_) => keep.clone(),
        None => BTreeSet::new(),
    };
    apply::delete_orphans(&policies, &selector, &keep_policy).await?;

    if let Some((reason, message)) = scaling.as_ref().and_then(|s| s.event.as_ref()) {
        autoscale::publish(ctx, obj, reason, message).await?;
    }

    // Status.
    let mut new_status = status::status(
        &valid,
        &applied,
        &children.template_conflicts,
        obj.engine_status(),
        ctx.now(),
    );
    new_status.autoscaling = scaling.map(|s| s.status);
    // A template that sets operator-owned fields is reported once per change, not every pass.
    if let Some(message) = status::new_template_conflict(obj.engine_status(), &new_status) {
        warn!(engine_pool = %name, %message, "spec.template sets fields the operator owns");
        controller::publish_warning(
            ctx,
            obj,
            kvpool_crd::conditions::reasons::OPERATOR_OWNED_FIELDS,
            "Reconcile",
            &message,
        )
        .await?;
    }
    let previous = obj.engine_status().map_or(&[][..], |s| &s.conditions[..]);
    match &mismatch {
        Some(mismatch) => {
            serving::api::set_and_report(
                ctx,
                obj,
                &mut new_status.conditions,
                previous,
                mismatch,
                valid.generation,
                ctx.now(),
            )
            .await?
        }
        None => conditions::keep(
            &mut new_status.conditions,
            previous,
            kvpool_crd::conditions::MODEL_MISMATCH,
        ),
    }
    if obj.engine_status() != Some(&new_status) {
        apply::patch_status(&ctx.settings.field_manager, &api, &name, &new_status).await?;
    }
    Ok(Outcome::Reconciled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_keep_their_metric_labels() {
        let labels = [
            Outcome::Reconciled,
            Outcome::PoolNotFound,
            Outcome::PoolInvalid,
            Outcome::Invalid,
            Outcome::Deleting,
        ]
        .map(Outcome::label);
        assert_eq!(
            labels,
            [
                "ok",
                "pool_not_found",
                "pool_invalid",
                "invalid",
                "deleting"
            ]
        );
    }
}
