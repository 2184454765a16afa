//! Pure construction of an engine pool's children: one Deployment of engine instances
//! (`deployment.rs`, running the container of `container.rs` after the init container of
//! `python.rs` that copies in the `kvpool` Python package, with the user's `spec.template`
//! merged under it by `template.rs`) and one Service in front of them, and its NetworkPolicy
//! (`network_policy.rs`), composed by [`build`]. The engine learns how to reach the pool from
//! environment variables and the mounted pool config (docs/engine-contract.md).
//! I/O boundary: none.

mod container;
mod deployment;
mod network_policy;
mod python;
mod template;

#[cfg(test)]
mod tests;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::validate::ValidEnginePool;
use crate::contract;
use crate::labels;
use crate::pod;

pub use container::{
    ENGINE_CAPABILITIES, command_args, engine_container, engine_env, engine_resources,
    engine_security,
};
pub use deployment::{engine_deployment, pod_annotations};
pub use network_policy::network_policy;
pub use python::{python_init_container, python_mount, python_path, python_volume};
pub use template::{SHM_VOLUME, merge as merge_template};

/// Children of an engine pool.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineChildren {
    pub deployment: Deployment,
    pub service: Service,
    /// Ingress of the engine pods; `None` when the pool's policies are turned off.
    pub network_policy: Option<NetworkPolicy>,
    /// The fields of `spec.template` that the operator's own values overrode (paths below the
    /// engine pool); empty when it merged cleanly or there is none.
    pub template_conflicts: Vec<String>,
}

/// The named port of the engine container and Service.
const ENGINE_PORTS: [(&str, u16); 1] = [("http", contract::ENGINE_PORT)];

/// Name of the engine Deployment and Service.
pub fn child_name(p: &ValidEnginePool) -> String {
    labels::child_name(&p.name, p.component)
}

/// Metadata of the engine Deployment and Service: name, labels, owner reference.
fn meta(p: &ValidEnginePool) -> ObjectMeta {
    labels::child_meta(
        child_name(p),
        &p.namespace,
        labels::child_labels(p.kind, &p.name, &p.pool.name, p.component),
        &p.owner,
    )
}

/// The label selector of the engine pods, as a string (for the scale subresource).
pub fn selector_string(p: &ValidEnginePool) -> String {
    kvpool_crd::labels::selector_string(&labels::selector_labels(
        &p.pool.name,
        &p.name,
        p.component,
    ))
}

/// The engine Deployment and Service. `config_hash` is the hash of the pool's ConfigMap data,
/// so engines restart when the pool's config changes.
pub fn build(p: &ValidEnginePool, config_hash: &str) -> EngineChildren {
    let selector = labels::selector_labels(&p.pool.name, &p.name, p.component);
    let mut deployment = engine_deployment(p, engine_container(p), config_hash);
    if let Some(tls) = &p.pool.spec.master.tls
        && let Some(pod) = crate::master_tls::deployment_pod(&mut deployment)
    {
        crate::master_tls::client_pod(pod, 0, tls);
    }
    if let Some(tls) = &p.pool.effective.transport.tls
        && let Some(pod) = crate::master_tls::deployment_pod(&mut deployment)
    {
        crate::transfer_tls::engine_pod(pod, 0, tls, &p.pool.name, &p.pool.namespace);
    }
    // The user's template last, under everything the operator put into the pod.
    let template_conflicts = match (&p.effective.template, deployment.spec.as_mut()) {
        (Some(t), Some(spec)) => merge_template(t, &mut spec.template),
        _ => Vec::new(),
    };
    EngineChildren {
        deployment,
        service: pod::service(meta(p), selector, &ENGINE_PORTS),
        network_policy: network_policy(p),
        template_conflicts,
    }
}
