//! Validation of a Prefill/DecodePool together with the KVCachePool it references (already
//! fetched by the dereference step): the result, [`ValidEnginePool`], is all `build` needs.
//! I/O boundary: none.

use std::collections::BTreeSet;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;
use kvpool::crd::{EngineKind, EngineResources, EngineSpec};

use super::kind::EnginePool;
use crate::cachepool::validate::{ValidCachePool, validate_name};
use crate::contract::EngineRole;
use crate::error::{Error, Result};
use crate::labels::Component;

/// An engine pool that passed validation, with its KVCachePool resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidEnginePool {
    pub kind: &'static str,
    pub name: String,
    pub namespace: String,
    pub generation: Option<i64>,
    pub owner: OwnerReference,
    pub role: EngineRole,
    pub component: Component,
    pub replicas: i32,
    pub engine: EngineSpec,
    pub resources: EngineResources,
    pub tensor_parallel_size: i32,
    pub pool: ValidCachePool,
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidSpec(msg.into())
}

/// Validate `obj` against the already validated KVCachePool `pool`.
pub fn validate<K: EnginePool>(obj: &K, pool: ValidCachePool) -> Result<ValidEnginePool> {
    let name = obj
        .meta()
        .name
        .clone()
        .ok_or(Error::MissingObjectKey("name"))?;
    let namespace = obj
        .namespace()
        .ok_or(Error::MissingObjectKey("namespace"))?;
    let owner = obj
        .controller_owner_ref(&())
        .ok_or(Error::MissingObjectKey("uid"))?;
    validate_name(&name)?;
    let v = obj.view();
    if v.replicas < 0 {
        return Err(invalid(format!(
            "spec.replicas must not be negative, got {}",
            v.replicas
        )));
    }
    if v.tensor_parallel_size < 1 {
        return Err(invalid(format!(
            "spec.tensorParallelSize must be at least 1, got {}",
            v.tensor_parallel_size
        )));
    }
    if v.resources.gpus < 0 || v.resources.gpus % v.tensor_parallel_size != 0 {
        return Err(invalid(format!(
            "spec.resources.gpus ({}) must be a non-negative multiple of spec.tensorParallelSize ({})",
            v.resources.gpus, v.tensor_parallel_size
        )));
    }
    if let Some(a) = v.autoscaling {
        if a.min_replicas > a.max_replicas {
            return Err(invalid(format!(
                "spec.autoscaling.minReplicas ({}) must not exceed spec.autoscaling.maxReplicas ({})",
                a.min_replicas, a.max_replicas
            )));
        }
        if v.replicas < a.min_replicas || v.replicas > a.max_replicas {
            return Err(invalid(format!(
                "spec.replicas ({}) must lie within spec.autoscaling.minReplicas..maxReplicas ({}..{})",
                v.replicas, a.min_replicas, a.max_replicas
            )));
        }
    }
    if v.slo_millis < 1 {
        return Err(invalid(
            "spec.slo must be a positive number of milliseconds",
        ));
    }
    match v.engine.kind {
        EngineKind::Vllm | EngineKind::Sglang => {
            if v.engine.model.as_deref().is_none_or(str::is_empty) {
                return Err(invalid(
                    "spec.engine.model is required for engine.kind vllm and sglang",
                ));
            }
        }
        EngineKind::Custom => {}
    }
    if v.engine.image.trim().is_empty() {
        return Err(invalid("spec.engine.image must not be empty"));
    }
    let mut seen = BTreeSet::new();
    for env in &v.engine.env {
        if !seen.insert(env.name.as_str()) {
            return Err(invalid(format!(
                "spec.engine.env lists {:?} twice",
                env.name
            )));
        }
    }
    for key in v.resources.rdma.keys() {
        if key == &v.resources.gpu_resource_name {
            return Err(invalid(format!(
                "spec.resources.rdma must not name the GPU resource {key:?}"
            )));
        }
    }
    Ok(ValidEnginePool {
        kind: K::KIND_NAME,
        name,
        namespace,
        generation: obj.meta().generation,
        owner,
        role: K::ROLE,
        component: K::COMPONENT,
        replicas: v.replicas,
        engine: v.engine.clone(),
        resources: v.resources.clone(),
        tensor_parallel_size: v.tensor_parallel_size,
        pool,
    })
}
