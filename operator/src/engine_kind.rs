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

/// Implements [`EnginePool`] for one kind: its name, its component, and the constructor of
/// [`ValidatedEnginePool`] that reads its spec.
macro_rules! engine_pool {
    ($kind:ident, $component:ident, $validate:ident) => {
        impl EnginePool for $kind {
            const KIND_NAME: &'static str = stringify!($kind);
            const COMPONENT: Component = Component::$component;

            fn pool_ref(&self) -> &str {
                &self.spec.kv_cache_pool_ref.name
            }

            fn validated(&self) -> Result<ValidatedEnginePool, SpecError> {
                ValidatedEnginePool::$validate(&self.spec)
            }

            fn engine_status(&self) -> Option<&EnginePoolStatus> {
                self.status.as_ref()
            }
        }
    };
}

engine_pool!(PrefillPool, Prefill, from_prefill);
engine_pool!(DecodePool, Decode, from_decode);
