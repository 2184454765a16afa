//! One view over the two engine-pool kinds: `PrefillPool` and `DecodePool` have the same shape
//! but distinct types, so the controller is generic over [`EnginePool`]. I/O boundary: none.

use std::fmt::Debug;

use k8s_openapi::NamespaceResourceScope;
use kube::Resource;
use kvpool::crd::{
    AutoscalingSpec, DecodePool, EnginePoolStatus, EngineResources, EngineSpec, PrefillPool,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::contract::EngineRole;
use crate::labels::Component;

/// The fields the controller needs, borrowed from either kind.
#[derive(Clone, Copy, Debug)]
pub struct EngineView<'a> {
    pub pool_ref: &'a str,
    pub replicas: i32,
    pub engine: &'a EngineSpec,
    pub resources: &'a EngineResources,
    pub tensor_parallel_size: i32,
    pub autoscaling: Option<&'a AutoscalingSpec>,
    /// TTFT objective for prefill, TPOT for decode, in milliseconds.
    pub slo_millis: i32,
}

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
    /// Role of the engines.
    const ROLE: EngineRole;
    /// Kind name, for metrics, labels and messages.
    const KIND_NAME: &'static str;
    /// Component label and child-name suffix.
    const COMPONENT: Component;

    fn view(&self) -> EngineView<'_>;
    fn engine_status(&self) -> Option<&EnginePoolStatus>;
}

impl EnginePool for PrefillPool {
    const ROLE: EngineRole = EngineRole::Prefill;
    const KIND_NAME: &'static str = "PrefillPool";
    const COMPONENT: Component = Component::Prefill;

    fn view(&self) -> EngineView<'_> {
        let s = &self.spec;
        EngineView {
            pool_ref: &s.kv_cache_pool_ref.name,
            replicas: s.replicas,
            engine: &s.engine,
            resources: &s.resources,
            tensor_parallel_size: s.tensor_parallel_size,
            autoscaling: s.autoscaling.as_ref(),
            slo_millis: s.slo.ttft_millis,
        }
    }

    fn engine_status(&self) -> Option<&EnginePoolStatus> {
        self.status.as_ref()
    }
}

impl EnginePool for DecodePool {
    const ROLE: EngineRole = EngineRole::Decode;
    const KIND_NAME: &'static str = "DecodePool";
    const COMPONENT: Component = Component::Decode;

    fn view(&self) -> EngineView<'_> {
        let s = &self.spec;
        EngineView {
            pool_ref: &s.kv_cache_pool_ref.name,
            replicas: s.replicas,
            engine: &s.engine,
            resources: &s.resources,
            tensor_parallel_size: s.tensor_parallel_size,
            autoscaling: s.autoscaling.as_ref(),
            slo_millis: s.slo.tpot_millis,
        }
    }

    fn engine_status(&self) -> Option<&EnginePoolStatus> {
        self.status.as_ref()
    }
}
