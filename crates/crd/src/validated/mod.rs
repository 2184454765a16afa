//! Effective settings of the custom resources: every default filled in, quantities resolved to
//! bytes, ranges and cross-field rules checked again in Rust (the operator's `validate` step, so
//! that `build` only ever sees consistent values). Pure, no I/O.
//!
//! `ValidatedKVCachePool` is also the data-plane view of a pool: it serializes (camelCase) into
//! the pool's ConfigMap, which the agent, master and conductor read.
//!
//! By concern: [`error`] (why a spec is refused, and the name and label-key rules), [`fields`] (range, size and
//! set checks of single fields), [`pool_config`] (the sections of a pool's effective settings),
//! [`kvcachepool`] (the `KVCachePool` rules), [`enginepool`] (the `PrefillPool` and `DecodePool`
//! rules).

mod enginepool;
mod error;
mod fields;
mod kvcachepool;
mod pool_config;

pub use enginepool::{AutoscalingConfig, Role, ValidatedEnginePool};
pub use error::{MAX_NAME_LEN, SpecError, check_label_value, validate_label_key, validate_name};
pub use kvcachepool::ValidatedKVCachePool;
pub use pool_config::{
    ConductorConfig, DramCapacity, DramConfig, EvictionConfig, MasterConfig, ReplicationConfig,
    SriovConfig, SriovRequest, SsdConfig, TransportConfig,
};

/// An object of kind `K` named `p` whose spec is `spec_yaml` (lines indented by two), as the
/// unit tests write their fixtures.
#[cfg(test)]
fn fixture<K>(spec_yaml: &str) -> K
where
    K: kube::Resource<DynamicType = ()> + serde::de::DeserializeOwned,
{
    let text = format!(
        "apiVersion: kvpool.dev/v1alpha1\nkind: {}\nmetadata:\n  name: p\nspec:\n{spec_yaml}",
        K::kind(&())
    );
    serde_saphyr::from_str(&text).expect("fixture parses")
}
