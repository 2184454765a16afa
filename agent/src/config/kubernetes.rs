//! The `kubernetes:` section of the agent's configuration: what the agent does with its own
//! Node object through the API server, with the pod's service account: read its failure domain
//! from a node label (the KVCachePool's `replication.spreadLabelKey`) and publish the
//! discovered topology as node labels. Validated into [`KubernetesConfig`]. I/O boundary: none
//! (pure).

use serde::{Deserialize, Serialize};

use super::{ConfigError, invalid};

/// `kubernetes:` as written.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct KubernetesSection {
    /// Node label whose value is this node's failure domain (read with `get nodes`).
    /// `pool.failure_domain` wins over it.
    pub failure_domain_label: Option<String>,
    /// Merge-patch the topology labels (`kvpool.dev/numa-nodes`, ...) onto the Node object
    /// (`patch nodes`).
    pub publish_topology: Option<bool>,
}

/// Validated `kubernetes:` settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KubernetesConfig {
    pub failure_domain_label: Option<String>,
    pub publish_topology: bool,
}

/// The label the kubelet sets to the node's name: as the spread label it needs no API call.
pub const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";

/// Why a configuration that needs the API server is refused by an agent built without the
/// `kube` feature (the lean `kvpool` binary, docs/adr/0011-lean-embedded-build.md).
pub const NO_KUBE: &str = "needs the Kubernetes API, but this kvpool was built without \
                           Kubernetes support; rebuild with --features k8s";

impl KubernetesConfig {
    /// Whether the agent needs the API server at all.
    pub fn uses_api(&self) -> bool {
        self.failure_domain_label.is_some() || self.publish_topology
    }

    /// Whether the failure domain must be read from the Node's labels: a spread label other
    /// than the hostname's, and no failure domain configured (`domain_configured`).
    pub fn needs_node_labels(&self, domain_configured: bool) -> bool {
        !domain_configured
            && self
                .failure_domain_label
                .as_deref()
                .is_some_and(|l| l != HOSTNAME_LABEL)
    }

    /// Whether the agent calls the API server at start-up: to read its labels or to publish
    /// its topology.
    pub fn needs_api(&self, domain_configured: bool) -> bool {
        self.needs_node_labels(domain_configured) || self.publish_topology
    }
}

/// Refuse, in an agent built without the `kube` feature, a configuration that needs the API
/// server, naming the setting that asks for it.
pub(super) fn check_support(
    k: &KubernetesConfig,
    domain_configured: bool,
) -> Result<(), ConfigError> {
    if cfg!(feature = "kube") {
        return Ok(());
    }
    if k.publish_topology {
        return Err(invalid(
            "kubernetes.publish_topology",
            format!("true {NO_KUBE}"),
        ));
    }
    if k.needs_node_labels(domain_configured) {
        return Err(invalid(
            "kubernetes.failure_domain_label",
            format!(
                "{:?} (without pool.failure_domain) {NO_KUBE}",
                k.failure_domain_label.as_deref().unwrap_or_default()
            ),
        ));
    }
    Ok(())
}

/// Validate the `kubernetes:` section.
pub(super) fn validate(k: &KubernetesSection) -> Result<KubernetesConfig, ConfigError> {
    let failure_domain_label = match k.failure_domain_label.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(key) => {
            kvpool_crd::validate_label_key("replication.spreadLabelKey", key).map_err(|e| {
                invalid(
                    "kubernetes.failure_domain_label",
                    format!("{key:?} is not a label key: {e}"),
                )
            })?;
            Some(key.to_owned())
        }
    };
    Ok(KubernetesConfig {
        failure_domain_label,
        publish_topology: k.publish_topology.unwrap_or(false),
    })
}
