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

impl KubernetesConfig {
    /// Whether the agent needs the API server at all.
    pub fn uses_api(&self) -> bool {
        self.failure_domain_label.is_some() || self.publish_topology
    }
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
