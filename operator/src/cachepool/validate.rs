//! Validation of a `KVCachePool`: the spec rules live in `kvpool_crd::ValidatedKVCachePool`
//! (shared with the data plane, which reads the result from the ConfigMap); this step adds what
//! only the operator cares about (object identity, child-name length) and resolves the images.
//! I/O boundary: none.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kvpool_crd::{KVCachePool, KVCachePoolSpec, ValidatedKVCachePool};

use crate::context::Settings;
use crate::contract;
use crate::error::{Error, Result};
pub use crate::identity::validate_name;
use crate::identity::{Identity, identity};
use crate::labels::{self, Component};

/// A `KVCachePool` that passed validation, with defaults resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidCachePool {
    pub name: String,
    pub namespace: String,
    pub generation: Option<i64>,
    pub owner: OwnerReference,
    /// The spec as written, for pod-level settings (node selector, tolerations, resources).
    pub spec: KVCachePoolSpec,
    /// Effective data-plane settings, all defaults filled in.
    pub effective: ValidatedKVCachePool,
    pub agent_image: String,
    pub master_image: String,
    pub conductor_image: String,
    /// The operator's own namespace, when known (see `Settings::operator_namespace`).
    pub operator_namespace: Option<String>,
    /// The agent credential issuer (see `Settings::agent_issuer`).
    pub agent_issuer: Option<crate::issuer::AgentIssuer>,
}

impl ValidCachePool {
    /// `host:port` of the master Service inside the cluster.
    pub fn master_addr(&self) -> String {
        master_addr(&self.name, &self.namespace)
    }
}

/// `host:port` of a pool's master Service.
pub fn master_addr(pool: &str, namespace: &str) -> String {
    format!(
        "{}.{namespace}.svc:{}",
        labels::child_name(pool, Component::Master),
        contract::MASTER_PORT
    )
}

/// Validate `pool` and resolve its defaults with the operator `settings`.
pub fn validate(pool: &KVCachePool, settings: &Settings) -> Result<ValidCachePool> {
    let Identity {
        name,
        namespace,
        owner,
    } = identity(pool)?;
    let spec = &pool.spec;
    let effective =
        ValidatedKVCachePool::validate(spec).map_err(|e| Error::InvalidSpec(e.to_string()))?;
    Ok(ValidCachePool {
        name,
        namespace,
        generation: pool.metadata.generation,
        owner,
        spec: spec.clone(),
        effective,
        agent_image: spec
            .agent
            .image
            .clone()
            .unwrap_or_else(|| settings.agent_image.clone()),
        master_image: spec
            .master
            .image
            .clone()
            .unwrap_or_else(|| settings.master_image.clone()),
        conductor_image: spec
            .conductor
            .image
            .clone()
            .unwrap_or_else(|| settings.conductor_image.clone()),
        operator_namespace: settings.operator_namespace.clone(),
        agent_issuer: settings.agent_issuer.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::{roce, tcp};

    #[test]
    fn resolves_images_from_settings_unless_the_spec_names_one() {
        let mut pool = tcp();
        let v = validate(&pool, &Settings::for_tests()).expect("valid");
        assert_eq!(v.agent_image, Settings::for_tests().agent_image);
        pool.spec.agent.image = Some("registry.local/agent:dev".into());
        let v = validate(&pool, &Settings::for_tests()).expect("valid");
        assert_eq!(v.agent_image, "registry.local/agent:dev");
        assert_eq!(v.master_addr(), "tcp-master.default.svc:50051");
    }

    #[test]
    fn invalid_specs_are_reported_with_the_field() {
        let mut pool = roce();
        pool.spec.eviction.low_watermark_percent = 99;
        let err = validate(&pool, &Settings::for_tests()).expect_err("low >= high");
        assert!(err.is_invalid_spec());
        assert!(
            err.to_string().contains("eviction.lowWatermarkPercent"),
            "{err}"
        );

        let mut pool = tcp();
        pool.spec.transport.networks = vec!["net".into()];
        let err = validate(&pool, &Settings::for_tests()).expect_err("multus with tcp");
        assert!(err.to_string().contains("transport.networks"), "{err}");

        let mut pool = tcp();
        pool.metadata.uid = None;
        let err = validate(&pool, &Settings::for_tests()).expect_err("no uid");
        assert_eq!(err.category(), "missing_object_key");

        let mut pool = tcp();
        pool.metadata.name = Some("a.b".into());
        let err = validate(&pool, &Settings::for_tests()).expect_err("dot");
        assert!(err.to_string().contains("metadata.name"), "{err}");
    }
}
