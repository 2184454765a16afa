//! The `KVCachePool` controller: dereference (nothing to resolve) -> validate -> build -> apply ->
//! status. Children are owned through controller references, so the garbage collector removes
//! them when the pool is deleted and no finalizer is needed (docs/operator.md explains why).
//! After the apply, the pool's usage is read from its master ([`usage`]); an unreachable master
//! keeps the last known figures and sets `MasterReachable=False` instead of failing the pass.
//! The pool key is derived from the operator's root key ([`crate::root_key`]), never read back
//! from the auth Secret: the operator may create Secrets and nothing more. A master that refuses
//! the derived key (a Secret the operator did not derive) gets a Warning Event and
//! `AuthKeyRejected=True`, and the pass goes on.
//! The engine pools that reference the pool are listed on each pass: they give the conductor the
//! served model's tensor parallel size and files ([`crate::serving::conductor`]) and decide the
//! `ModelMismatch` condition (with a Warning Event when it turns True or changes).
//! I/O boundary: the lists of the engine pools, the apply step (NetworkPolicies before the workloads they protect) and the
//! status write, both through [`crate::apply`], the Events, and the master's `Stats` call.

pub mod build;
pub mod node_status;
pub mod status;
pub mod validate;

/// The pool's usage as its master reports it (formerly this module; the reader is injected
/// through the [`Context`], so it lives below it).
pub use crate::pool_usage as usage;

use kvpool_runtime::telemetry::chain;
use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use kvpool_crd::KVCachePool;
use tracing::{info, instrument, warn};

use crate::apply;
use crate::conditions::reason;
use crate::context::{Context, PROGRESS_REQUEUE, USAGE_REFRESH};
use crate::controller;
use crate::error::{Error, Result};
use crate::labels;
use crate::pool_usage;
use crate::serving;
use build::OWNER_KIND;
use status::{AppliedCachePool, UsageReading};

/// Metric label of this controller.
pub const KIND: &str = "KVCachePool";

/// What a reconcile did, for metrics (labelled by [`Outcome::label`]) and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum Outcome {
    /// Children applied and status up to date, usage read from the master.
    #[strum(serialize = "ok")]
    Reconciled,
    /// Children applied and status up to date, but the master did not report usage: retried
    /// sooner than a healthy pool's refresh.
    #[strum(serialize = "no_usage")]
    ReconciledWithoutUsage,
    /// The spec is invalid: Event and condition written, waiting for a change.
    Invalid,
    /// The pool is being deleted: nothing to do (the garbage collector removes the children).
    Deleting,
}

impl Outcome {
    /// Metric label of the outcome.
    pub fn label(self) -> &'static str {
        self.into()
    }
}

fn key(pool: &KVCachePool) -> String {
    format!(
        "{}/{}",
        pool.namespace().unwrap_or_default(),
        pool.name_any()
    )
}

/// Entry point for the kube runtime controller.
pub async fn reconcile(pool: Arc<KVCachePool>, ctx: Arc<Context>) -> Result<Action> {
    let pass = controller::Pass::start(&ctx, KIND);
    let result = reconcile_pool(&pool, &ctx).await;
    let outcome = pass.finish(&key(&pool), result, Outcome::label)?;
    Ok(match outcome {
        Outcome::Reconciled => Action::requeue(USAGE_REFRESH),
        Outcome::ReconciledWithoutUsage => Action::requeue(PROGRESS_REQUEUE),
        Outcome::Invalid | Outcome::Deleting => Action::await_change(),
    })
}

/// Retry policy: per-object exponential backoff for transient failures; an invalid object
/// waits for a change.
pub fn error_policy(pool: Arc<KVCachePool>, err: &Error, ctx: Arc<Context>) -> Action {
    let key = key(&pool);
    let Some(delay) = controller::retry_delay(&ctx, err, &key) else {
        return Action::await_change();
    };
    warn!(pool = %key, error = %chain(&err), category = err.category(), retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// One pass of the pipeline. Public so that tests drive it directly.
#[instrument(skip_all, fields(pool = %pool.name_any(), namespace = pool.namespace().unwrap_or_default()))]
pub async fn reconcile_pool(pool: &KVCachePool, ctx: &Context) -> Result<Outcome> {
    if pool.meta().deletion_timestamp.is_some() {
        return Ok(Outcome::Deleting);
    }
    let namespace = pool
        .namespace()
        .ok_or(Error::MissingObjectKey("namespace"))?;
    let name = pool
        .metadata
        .name
        .clone()
        .ok_or(Error::MissingObjectKey("name"))?;
    let pools: Api<KVCachePool> = Api::namespaced(ctx.client.clone(), &namespace);

    let valid = match validate::validate(pool, &ctx.settings) {
        Ok(v) => v,
        Err(Error::InvalidSpec(message)) => {
            report_invalid(pool, ctx, &message).await?;
            let status = status::invalid_status(
                pool.status.as_ref(),
                pool.metadata.generation,
                &message,
                ctx.now(),
            );
            if pool.status.as_ref() != Some(&status) {
                apply::patch_status(&ctx.settings.field_manager, &pools, &name, &status).await?;
            }
            return Ok(Outcome::Invalid);
        }
        Err(other) => return Err(other),
    };

    // The uid makes a pool deleted and created again under its name get a new key.
    let uid = pool
        .metadata
        .uid
        .as_deref()
        .ok_or(Error::MissingObjectKey("uid"))?;
    let pool_key = ctx.root_key.pool_key_hex(&namespace, &name, uid);
    // The engine pools that use the pool: what the conductor is told of the served model, and
    // whether they can serve their models together (`ModelMismatch`).
    let engines = serving::api::engine_pools(ctx, &namespace, &name).await?;
    let children = build::build_for(&valid, &pool_key, &serving::conductor_facts(&engines))?;
    let applied = apply_children(ctx, &namespace, &name, children).await?;
    let usage = read_usage(ctx, &valid, &pool_key).await;
    let outcome = match &usage {
        UsageReading::Read(u) => {
            let degraded = status::degraded_nodes(valid.effective.transport.protocol, u);
            ctx.metrics
                .set_transport_degraded(&namespace, &name, degraded);
            Outcome::Reconciled
        }
        UsageReading::Failed { .. } => Outcome::ReconciledWithoutUsage,
        UsageReading::Rejected { addr, message } => {
            report_rejected_key(pool, ctx, &valid, addr, message).await?;
            Outcome::ReconciledWithoutUsage
        }
    };

    let mut new_status = status::status(&valid, &applied, &usage, pool.status.as_ref(), ctx.now());
    let previous_conditions = pool.status.as_ref().map_or(&[][..], |s| &s.conditions[..]);
    serving::api::set_and_report(
        ctx,
        pool,
        &mut new_status.conditions,
        previous_conditions,
        &serving::pool_condition(&name, &engines),
        valid.generation,
        ctx.now(),
    )
    .await?;
    if pool.status.as_ref() != Some(&new_status) {
        apply::patch_status(&ctx.settings.field_manager, &pools, &name, &new_status).await?;
        info!(
            ready = new_status.nodes_ready,
            desired = new_status.nodes_desired,
            "status updated"
        );
    }
    Ok(outcome)
}

/// Ask the pool's master for its usage, signed as the pool's `observer`. Never fails the pass:
/// a silent master becomes [`UsageReading::Failed`], a refused credential
/// [`UsageReading::Rejected`] (logged, and reported as conditions).
async fn read_usage(
    ctx: &Context,
    pool: &validate::ValidCachePool,
    pool_key_hex: &str,
) -> UsageReading {
    let addr = ctx.master_addr(pool.master_addr());
    let Some(key) = pool_usage::observer_key(pool_key_hex) else {
        // A derived key is 64 hex characters; this cannot happen.
        return UsageReading::Failed {
            addr,
            category: "auth_key",
        };
    };
    match ctx
        .master_stats
        .stats(&addr, pool.spec.master.tls.as_ref(), key)
        .await
    {
        Ok(u) => UsageReading::Read(u),
        Err(pool_usage::UsageError::AuthRejected { addr, message }) => {
            warn!(master = %addr, %message, "the master refused the operator's derived key");
            UsageReading::Rejected { addr, message }
        }
        Err(e) => {
            warn!(master = %addr, error = %chain(&e), "cannot read pool usage");
            UsageReading::Failed {
                addr,
                category: e.category(),
            }
        }
    }
}

/// A Warning Event when the master starts refusing the derived key (not again while
/// `AuthKeyRejected` stays True, so a stuck pool does not flood its Events).
async fn report_rejected_key(
    pool: &KVCachePool,
    ctx: &Context,
    valid: &validate::ValidCachePool,
    addr: &str,
    answer: &str,
) -> Result<()> {
    let already = pool.status.as_ref().is_some_and(|s| {
        kvpool_crd::conditions::is_true(&s.conditions, kvpool_crd::conditions::AUTH_KEY_REJECTED)
    });
    if already {
        return Ok(());
    }
    let message = status::rejected_message(valid, addr, answer);
    controller::publish_warning(
        ctx,
        pool,
        kvpool_crd::conditions::AUTH_KEY_REJECTED,
        "ReadUsage",
        &message,
    )
    .await
}

async fn report_invalid(pool: &KVCachePool, ctx: &Context, message: &str) -> Result<()> {
    warn!(%message, "invalid spec");
    controller::publish_warning(ctx, pool, reason::INVALID_SPEC, "Validate", message).await
}

/// Deletes the children of kind `K` that `selector` matches and `keep` does not name (left by a
/// feature turned off), and logs each.
async fn prune<K>(api: &Api<K>, selector: &str, keep: &BTreeSet<String>) -> Result<()>
where
    K: Resource<DynamicType = ()> + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    for gone in apply::delete_orphans(api, selector, keep).await? {
        info!(kind = %K::kind(&()), name = %gone, "deleted child of a feature turned off");
    }
    Ok(())
}

async fn apply_children(
    ctx: &Context,
    namespace: &str,
    name: &str,
    children: build::CachePoolChildren,
) -> Result<AppliedCachePool> {
    let client = ctx.client.clone();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let services: Api<Service> = Api::namespaced(client.clone(), namespace);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    let daemonsets: Api<DaemonSet> = Api::namespaced(client, namespace);

    // Created once; an existing Secret is left as it is and never read (409 is fine).
    if apply::create_if_absent(&ctx.settings.field_manager, &secrets, &children.auth).await? {
        info!(secret = %children.auth.name_any(), "created the pool's auth Secret with its derived key");
    }
    apply::apply(&ctx.settings.field_manager, &config_maps, &children.config).await?;
    // The policies exist before the pods they admit traffic to.
    let network_policies: Api<NetworkPolicy> = Api::namespaced(ctx.client.clone(), namespace);
    let mut keep_policies = BTreeSet::new();
    for policy in &children.network_policies {
        apply::apply(&ctx.settings.field_manager, &network_policies, policy).await?;
        keep_policies.insert(policy.name_any());
    }
    apply::apply(
        &ctx.settings.field_manager,
        &services,
        &children.master_service,
    )
    .await?;
    let master =
        apply::apply_workload(&ctx.settings.field_manager, &deployments, &children.master).await?;
    let agent =
        apply::apply_workload(&ctx.settings.field_manager, &daemonsets, &children.agent).await?;

    let mut keep_deployments = BTreeSet::from([children.master.name_any()]);
    let mut keep_services = BTreeSet::from([children.master_service.name_any()]);
    let service_accounts: Api<ServiceAccount> = Api::namespaced(ctx.client.clone(), namespace);
    let roles: Api<Role> = Api::namespaced(ctx.client.clone(), namespace);
    let role_bindings: Api<RoleBinding> = Api::namespaced(ctx.client.clone(), namespace);
    let selector = labels::owner_selector(OWNER_KIND, name);
    match &children.conductor_rbac {
        // The identity exists before the pods that use it.
        Some(rbac) => {
            let fm = &ctx.settings.field_manager;
            apply::apply(fm, &service_accounts, &rbac.service_account).await?;
            apply::apply(fm, &roles, &rbac.role).await?;
            apply::apply(fm, &role_bindings, &rbac.role_binding).await?;
        }
        // Conductor off: its identity goes (only looked for then, to spare three lists a pass).
        None => {
            let none = BTreeSet::new();
            prune(&role_bindings, &selector, &none).await?;
            prune(&roles, &selector, &none).await?;
            prune(&service_accounts, &selector, &none).await?;
        }
    }
    let conductor = match &children.conductor {
        Some((deployment, service)) => {
            apply::apply(&ctx.settings.field_manager, &services, service).await?;
            keep_services.insert(service.name_any());
            keep_deployments.insert(deployment.name_any());
            Some(
                apply::apply_workload(&ctx.settings.field_manager, &deployments, deployment)
                    .await?,
            )
        }
        None => None,
    };

    prune(&deployments, &selector, &keep_deployments).await?;
    prune(&services, &selector, &keep_services).await?;
    prune(&network_policies, &selector, &keep_policies).await?;
    Ok(AppliedCachePool {
        agent,
        master,
        conductor,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_keep_their_metric_labels() {
        for (outcome, label) in [
            (Outcome::Reconciled, "ok"),
            (Outcome::ReconciledWithoutUsage, "no_usage"),
            (Outcome::Invalid, "invalid"),
            (Outcome::Deleting, "deleting"),
        ] {
            assert_eq!(outcome.label(), label);
        }
    }
}
