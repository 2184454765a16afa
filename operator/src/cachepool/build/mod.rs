//! Pure construction of a `KVCachePool`'s children from a [`ValidCachePool`], one builder file
//! per child kind: the effective config ConfigMap (`config.rs`), the auth Secret (`auth.rs`),
//! the agent DaemonSet (`agent.rs`), the master Deployment and Service (`master.rs`) and, when
//! enabled, the conductor Deployment and Service (`conductor.rs`) with the ServiceAccount, Role
//! and RoleBinding that let it list and watch the engine pods it discovers
//! (`conductor_rbac.rs`), and the NetworkPolicies that admit only the traffic the pool needs
//! (`network_policy.rs`). The master and conductor share one Deployment shape (`workload.rs`).
//! [`build`] composes them. No client, no clock, no randomness: the auth key is passed in.
//! I/O boundary: none.

mod agent;
mod auth;
mod conductor;
mod conductor_rbac;
mod config;
mod master;
mod network_policy;
mod workload;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};

use super::validate::ValidCachePool;
use crate::error::Result;
use crate::labels::{self, Component};
use crate::master_tls;
use crate::pod;
use crate::serving::ConductorFacts;

pub use agent::{AGENT_CAPABILITIES, agent_daemonset};
pub use auth::{ROLE_ITEMS, auth_secret};
pub use conductor::conductor;
pub use conductor_rbac::{CONDUCTOR_POD_VERBS, ConductorRbac, conductor_rbac};
pub use config::{PoolConfig, config_data, config_hash, engine_config, pool_config};
pub use master::{master_deployment, master_service};
pub use network_policy::{OPERATOR_POD_LABELS, network_policies, operator_pods, pool_pods};
pub(crate) use network_policy::{namespace_pods, peers, rule};
pub use pod::{KEY_READER_GROUP, auth_volume, common_mounts, config_volume, socket_volume};

/// Kind label value of children owned by a KVCachePool.
pub const OWNER_KIND: &str = "KVCachePool";

/// Everything a KVCachePool owns.
#[derive(Clone, Debug, PartialEq)]
pub struct CachePoolChildren {
    pub config: ConfigMap,
    pub auth: Secret,
    pub agent: DaemonSet,
    pub master: Deployment,
    pub master_service: Service,
    /// Absent when the conductor is disabled.
    pub conductor: Option<(Deployment, Service)>,
    /// The conductor's identity and its right to discover engine pods; absent when disabled.
    pub conductor_rbac: Option<ConductorRbac>,
    /// Ingress policies of master, agents and conductor; empty when turned off.
    pub network_policies: Vec<NetworkPolicy>,
}

/// Every child of `pool`. `key_hex` is the pool key derived from the root key (stored only when
/// the auth Secret does not exist yet).
pub fn build(pool: &ValidCachePool, key_hex: &str) -> Result<CachePoolChildren> {
    build_for(pool, key_hex, &ConductorFacts::default())
}

/// [`build`] with what the pool's engine pools tell the conductor about the served model
/// (`facts`, from [`crate::serving::conductor_facts`]).
pub fn build_for(
    pool: &ValidCachePool,
    key_hex: &str,
    facts: &ConductorFacts,
) -> Result<CachePoolChildren> {
    let data = config_data(pool)?;
    let hash = config_hash(&data);
    let mut agent = agent_daemonset(pool, &hash);
    let mut master = master_deployment(pool, &hash);
    let mut conductor = pool
        .effective
        .conductor
        .is_some()
        .then(|| conductor(pool, &hash, facts));
    // TLS of the master: its certificate in the master, its CA (and the client certificate)
    // in every client of it.
    if let Some(tls) = &pool.spec.master.tls {
        if let Some(p) = master_tls::deployment_pod(&mut master) {
            master_tls::master_pod(p, tls);
        }
        if let Some(p) = master_tls::daemonset_pod(&mut agent) {
            master_tls::client_pod(p, 0, tls);
        }
        if let Some(p) = conductor
            .as_mut()
            .and_then(|(d, _)| master_tls::deployment_pod(d))
        {
            master_tls::client_pod(p, 0, tls);
        }
    }
    // TLS of the transfer lanes: every agent serves the pool's transfer certificate.
    if let Some(tls) = &pool.effective.transport.tls
        && let Some(p) = master_tls::daemonset_pod(&mut agent)
    {
        crate::transfer_tls::agent_pod(p, 0, tls);
    }
    Ok(CachePoolChildren {
        config: config::config_map(pool, data),
        auth: auth_secret(pool, key_hex),
        agent,
        master,
        master_service: master_service(pool),
        conductor,
        conductor_rbac: pool
            .effective
            .conductor
            .is_some()
            .then(|| conductor_rbac(pool)),
        network_policies: network_policies(pool),
    })
}

/// Metadata of the pool's child of `component`: deterministic name, labels, owner reference.
fn meta(pool: &ValidCachePool, component: Component) -> ObjectMeta {
    labels::child_meta(
        labels::child_name(&pool.name, component),
        &pool.namespace,
        pod_labels(pool, component),
        &pool.owner,
    )
}

/// Selector of the pool's pods of `component`.
fn selector(pool: &ValidCachePool, component: Component) -> LabelSelector {
    pod::label_selector(labels::selector_labels(&pool.name, &pool.name, component))
}

/// Labels of the pool's pods (and children) of `component`.
fn pod_labels(pool: &ValidCachePool, component: Component) -> BTreeMap<String, String> {
    labels::child_labels(OWNER_KIND, &pool.name, &pool.name, component)
}
