//! One view over the two engine-pool kinds: `PrefillPool` and `DecodePool` have the same shape
//! but distinct types, so the controller is generic over [`EnginePool`]. I/O boundary: none.

use std::fmt::Debug;

use k8s_openapi::NamespaceResourceScope;
use kube::Resource;
use kvpool_crd::{DecodePool, EnginePoolStatus, PrefillPool, SpecError, ValidatedEnginePool};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::labels::Component;

/// A Prefill- or DecodePool.
pub trait EnginePool:
    Resource<DynamicType = (), Scope = NamespaceResourceScope>
    + Clone
    + Debug
    + Serialize
    + DeserializeOwned
    + Send
    + Sync
    + 'static
{
    /// Kind name, for metrics, labels and messages.
    const KIND_NAME: &'static str;
    /// Component label and child-name suffix.
    const COMPONENT: Component;

    /// Name of the referenced KVCachePool.
    fn pool_ref(&self) -> &str;
    /// The spec with defaults resolved and rules checked.
    fn validated(&self) -> Result<ValidatedEnginePool, SpecError>;
    /// Current status, if any.
    fn engine_status(&self) -> Option<&EnginePoolStatus>;
}

impl EnginePool for PrefillPool {
    const KIND_NAME: &'static str = "PrefillPool";
    const COMPONENT: Component = Component::Prefill;

    fn pool_ref(&self) -> &str {
        &self.spec.kv_cache_pool_ref.name
    }

    fn validated(&self) -> Result<ValidatedEnginePool, SpecError> {
        ValidatedEnginePool::from_prefill(&self.spec)
    }

    fn engine_status(&self) -> Option<&EnginePoolStatus> {
        self.status.as_ref()
    }
}

impl EnginePool for DecodePool {
    const KIND_NAME: &'static str = "DecodePool";
    const COMPONENT: Component = Component::Decode;

    fn pool_ref(&self) -> &str {
        &self.spec.kv_cache_pool_ref.name
    }

    fn validated(&self) -> Result<ValidatedEnginePool, SpecError> {
        ValidatedEnginePool::from_decode(&self.spec)
    }

    fn engine_status(&self) -> Option<&EnginePoolStatus> {
        self.status.as_ref()
    }
}
