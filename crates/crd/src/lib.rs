//! Kubernetes custom resources of kvpool (group `kvpool.dev`, version `v1alpha1`): the types,
//! their generated CustomResourceDefinitions and YAML rendering, shared constants (labels,
//! condition types and reasons) and the pure resolution of defaulted settings. No I/O: callers
//! write the rendered YAML wherever they like.

pub mod conditions;
mod conductor;
pub mod defaults;
mod enginepool;
mod kvcachepool;
pub mod labels;
mod master_tls;
mod network;
mod persistence;
mod pod_template;
mod pool_status;
pub mod quantity;
mod validated;

pub use enginepool::{
    AutoscalingSignal, AutoscalingSpec, DecodePool, DecodePoolSpec, DecodeSlo,
    EngineAutoscalingStatus, EngineKind, EnginePoolStatus, EngineResources, EngineSpec,
    KVCachePoolRef, PrefillPool, PrefillPoolSpec, PrefillSlo,
};
pub use kvcachepool::{
    AgentSpec, ConductorSlo, ConductorSpec, DramTierSpec, EvictionPolicy, EvictionSpec, Hugepages,
    KVCachePool, KVCachePoolSpec, MasterSpec, NetworkPolicySpec, NumaPolicy, Protocol,
    ReplicationSpec, SPREAD_NEEDS_NODE_ACCESS, SriovResource, SriovSpec, SsdTierSpec,
    TokenizerSpec, TransferIntegrity, TransportSpec,
};
pub use master_tls::{MasterTlsSpec, TRANSFER_TLS_DIR, TransferTlsMode, TransferTlsSpec};
pub use pool_status::{
    KVCachePoolStatus, MAX_STATUS_NODES, NodeStatus, NodeTransportStatus, NumaStatus, TierStatus,
};

pub use network::{
    CONDUCTOR_PEER_MESSAGE, ConductorPeer, ENGINE_PEER_MESSAGE, EnginePeer, METRICS_PEER_MESSAGE,
    MetricsPeer, SSD_HOST_PATH_MESSAGE, SSD_HOST_PATH_PREFIXES, SSD_HOST_PATH_RULE,
    ssd_host_path_allowed,
};
pub use persistence::{
    DRAM_HOST_PATH_MESSAGE, DRAM_HOST_PATH_PREFIXES, DRAM_HOST_PATH_RULE,
    DRAM_INDEX_HOST_PATH_MESSAGE, DramPersistenceConfig, DramPersistenceSpec, PersistenceMode,
    dram_host_path_allowed,
};
pub use pod_template::{
    ENGINE_CONTAINER, EnginePodMetadata, EnginePodSpec, EnginePodTemplate, SecretKeyRef,
};
pub use validated::{
    AutoscalingConfig, ConductorConfig, DramCapacity, DramConfig, EvictionConfig, MAX_NAME_LEN,
    MasterConfig, ReplicationConfig, Role, SpecError, SriovConfig, SriovRequest, SsdConfig,
    TransportConfig, ValidatedEnginePool, ValidatedKVCachePool, check_label_value,
    validate_label_key, validate_name,
};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

/// API group of every kvpool resource.
pub const GROUP: &str = "kvpool.dev";
/// API version of the resources in this module.
pub const VERSION: &str = "v1alpha1";

/// Group id of the kvpool images' non-root user. Pods the operator runs as non-root (master,
/// conductor, engines) get it as `fsGroup`, so the pool's auth key and the node agent's socket
/// and staging files are readable and writable through group permissions.
pub const POOL_CLIENT_GROUP: u32 = 65532;

/// Failures of this module.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum CrdError {
    /// A CustomResourceDefinition could not be rendered as YAML.
    #[error("rendering CustomResourceDefinition {name} as YAML")]
    RenderYaml {
        /// `metadata.name` of the definition.
        name: String,
        /// What the serializer reported.
        #[source]
        source: serde_saphyr::ser::Error,
    },
}

impl CrdError {
    /// Short stable label for metrics and Events.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// The three CustomResourceDefinitions, in a fixed order: KVCachePool, PrefillPool, DecodePool.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![KVCachePool::crd(), PrefillPool::crd(), DecodePool::crd()]
}

/// One CRD rendered for `crds/`: the file name (`<plural>.<group>.yaml`) and its YAML document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedCrd {
    /// File name inside `crds/`, e.g. `kvcachepools.kvpool.dev.yaml`.
    pub file_name: String,
    /// The YAML document, starting with a comment that says it is generated.
    pub yaml: String,
}

/// Header written at the top of every generated CRD file.
pub const GENERATED_HEADER: &str = "# Generated from the Rust types in crates/crd/ by `kvpool operator crd`.\n\
     # Do not edit: change the types and regenerate (see docs/crds.md).\n";

/// Renders one CustomResourceDefinition as a YAML document with the generated-file header.
pub fn crd_to_yaml(crd: &CustomResourceDefinition) -> Result<String, CrdError> {
    let body = serde_saphyr::to_string(crd).map_err(|source| CrdError::RenderYaml {
        name: crd.metadata.name.clone().unwrap_or_default(),
        source,
    })?;
    Ok(format!("{GENERATED_HEADER}---\n{body}"))
}

/// Renders the three CRDs for `crds/`, in the order of [`crds`].
pub fn render_crds() -> Result<Vec<RenderedCrd>, CrdError> {
    crds()
        .iter()
        .map(|crd| {
            Ok(RenderedCrd {
                file_name: format!("{}.yaml", crd.metadata.name.as_deref().unwrap_or("unnamed")),
                yaml: crd_to_yaml(crd)?,
            })
        })
        .collect()
}

/// The three CRDs as one multi-document YAML stream (what `kubectl apply -f -` takes).
pub fn crds_yaml() -> Result<String, CrdError> {
    Ok(render_crds()?
        .into_iter()
        .map(|r| r.yaml)
        .collect::<Vec<_>>()
        .join(""))
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

    #[test]
    fn rendered_files_are_named_after_the_crds_and_marked_generated() {
        let rendered = render_crds().expect("renders");
        let names: Vec<_> = rendered.iter().map(|r| r.file_name.as_str()).collect();
        assert_eq!(
            names,
            [
                "kvcachepools.kvpool.dev.yaml",
                "prefillpools.kvpool.dev.yaml",
                "decodepools.kvpool.dev.yaml"
            ]
        );
        for r in &rendered {
            assert!(r.yaml.starts_with(GENERATED_HEADER), "{}", r.file_name);
            assert!(
                r.yaml.contains("kind: CustomResourceDefinition"),
                "{}",
                r.file_name
            );
        }
        let stream = crds_yaml().expect("renders");
        assert_eq!(stream.matches("\n---\n").count(), 3);
    }

    #[test]
    fn every_crd_has_status_short_name_and_category() {
        for crd in crds() {
            let names = &crd.spec.names;
            assert_eq!(crd.spec.group, GROUP);
            assert_eq!(crd.spec.scope, "Namespaced");
            assert_eq!(
                names.categories.as_deref(),
                Some(&["kvpool".to_owned()][..])
            );
            assert_eq!(names.short_names.as_ref().map(Vec::len), Some(1));
            let version = &crd.spec.versions[0];
            assert_eq!(version.name, VERSION);
            assert!(version.served && version.storage);
            assert!(
                version
                    .subresources
                    .as_ref()
                    .is_some_and(|s| s.status.is_some())
            );
            let columns = version
                .additional_printer_columns
                .as_deref()
                .unwrap_or_default();
            assert!(
                columns.iter().any(|c| c.name == "Age"),
                "{:?}",
                crd.metadata.name
            );
            assert!(
                columns.iter().any(|c| c.name == "Ready"),
                "{:?}",
                crd.metadata.name
            );
        }
    }
}
