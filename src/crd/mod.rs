//! Kubernetes custom resources of kvpool (group `kvpool.dev`, version `v1alpha1`): the types,
//! their generated CustomResourceDefinitions and YAML rendering, shared constants (labels,
//! condition types and reasons) and the pure resolution of defaulted settings. No I/O: callers
//! write the rendered YAML wherever they like.

pub mod defaults;
mod enginepool;
mod kvcachepool;

pub use enginepool::{
    AutoscalingSignal, AutoscalingSpec, DecodePool, DecodePoolSpec, DecodeSlo, EngineKind,
    EnginePoolStatus, EngineResources, EngineSpec, KVCachePoolRef, PrefillPool, PrefillPoolSpec,
    PrefillSlo,
};
pub use kvcachepool::{
    AgentSpec, ConductorSlo, ConductorSpec, DramTierSpec, EvictionPolicy, EvictionSpec, Hugepages,
    KVCachePool, KVCachePoolSpec, KVCachePoolStatus, MasterSpec, NumaPolicy, Protocol,
    ReplicationSpec, SriovSpec, SsdTierSpec, TierStatus, TransportSpec,
};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

/// API group of every kvpool resource.
pub const GROUP: &str = "kvpool.dev";
/// API version of the resources in this module.
pub const VERSION: &str = "v1alpha1";

/// The three CustomResourceDefinitions, in a fixed order: KVCachePool, PrefillPool, DecodePool.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![KVCachePool::crd(), PrefillPool::crd(), DecodePool::crd()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crds_have_names_in_kvpool_group() {
        let names: Vec<_> = crds().into_iter().filter_map(|c| c.metadata.name).collect();
        assert_eq!(
            names,
            [
                "kvcachepools.kvpool.dev",
                "prefillpools.kvpool.dev",
                "decodepools.kvpool.dev"
            ]
        );
    }
}
