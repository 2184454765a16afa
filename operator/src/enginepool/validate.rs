//! Validation of a Prefill/DecodePool together with the KVCachePool it references (already
//! fetched and validated by the dereference step). Spec rules live in
//! `kvpool_crd::ValidatedEnginePool`; this step adds object identity, child-name length and
//! what server-side apply would reject (duplicate env names, a container or volume name of
//! `spec.template` used twice). I/O boundary: none.

use std::collections::BTreeSet;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kvpool_crd::ValidatedEnginePool;

use crate::cachepool::validate::ValidCachePool;
use crate::engine_kind::EnginePool;
use crate::error::{Error, Result};
use crate::identity::{Identity, identity};
use crate::labels::Component;

/// An engine pool that passed validation, with its KVCachePool resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidEnginePool {
    pub kind: &'static str,
    pub name: String,
    pub namespace: String,
    pub generation: Option<i64>,
    pub owner: OwnerReference,
    pub component: Component,
    pub effective: ValidatedEnginePool,
    pub pool: ValidCachePool,
}

/// Validate `obj` against the already validated KVCachePool `pool`.
pub fn validate<K: EnginePool>(obj: &K, pool: ValidCachePool) -> Result<ValidEnginePool> {
    let Identity {
        name,
        namespace,
        owner,
    } = identity(obj)?;
    let effective = obj
        .validated()
        .map_err(|e| Error::InvalidSpec(e.to_string()))?;
    let mut seen = BTreeSet::new();
    for env in &effective.env {
        if !seen.insert(env.name.as_str()) {
            return Err(Error::InvalidSpec(format!(
                "spec.engine.env: {:?} is listed twice",
                env.name
            )));
        }
    }
    if let Some(spec) = effective.template.as_ref().and_then(|t| t.spec.as_ref()) {
        // A pod's containers and init containers share one namespace of names.
        let mut names = BTreeSet::new();
        let containers = spec
            .containers
            .iter()
            .map(|c| ("containers", &c.name))
            .chain(
                spec.init_containers
                    .iter()
                    .map(|c| ("initContainers", &c.name)),
            );
        for (field, name) in containers {
            if !names.insert(name.as_str()) {
                return Err(Error::InvalidSpec(format!(
                    "spec.template.spec.{field}: the container name {name:?} is used twice in the pod"
                )));
            }
        }
        let mut volumes = BTreeSet::new();
        for v in &spec.volumes {
            if !volumes.insert(v.name.as_str()) {
                return Err(Error::InvalidSpec(format!(
                    "spec.template.spec.volumes: {:?} is listed twice",
                    v.name
                )));
            }
        }
    }
    if effective.rdma.contains_key(&effective.gpu_resource_name) {
        return Err(Error::InvalidSpec(format!(
            "spec.resources.rdma: must not name the GPU resource {:?}",
            effective.gpu_resource_name
        )));
    }
    Ok(ValidEnginePool {
        kind: K::KIND_NAME,
        name,
        namespace,
        generation: obj.meta().generation,
        owner,
        component: K::COMPONENT,
        effective,
        pool,
    })
}
