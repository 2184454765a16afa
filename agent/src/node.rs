//! The agent's own Node object, read and labelled through the API server with the pod's
//! service account (RBAC: `get` and `patch` on `nodes`, docs/install.md): the node's failure
//! domain is its value of the pool's spread label, and the discovered topology is published as
//! `kvpool.dev/...` labels and annotations with one JSON merge patch. Nothing here stops the
//! agent: a missing label or an API error leaves the failure domain empty, with a warning and
//! a metric. I/O boundary: the API server ([`NodeClient`]); [`topology_patch`] and
//! [`choose_failure_domain`] are pure. The client is the crate's `kube` feature; built without
//! it, [`NodeClient`] has no values and the configuration refuses what would need one
//! (`crate::config::kubernetes`).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
#[cfg(feature = "kube")]
use kube::api::{Api, Patch, PatchParams};
use prometheus::{IntCounterVec, IntGauge, Registry};

use crate::config::AgentConfig;
use crate::topology::NodeSummary;
use kvpool_runtime::metrics::{counters, gauge};

/// Field manager of the agent's writes to its Node object.
pub const FIELD_MANAGER: &str = "kvpool-agent";

pub use crate::config::kubernetes::HOSTNAME_LABEL;

/// Errors of talking to the API server about this node.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum NodeError {
    #[cfg(feature = "kube")]
    #[error("no Kubernetes client configuration (in-cluster service account or kubeconfig)")]
    Config(#[source] kube::Error),
    #[cfg(feature = "kube")]
    #[error("reading Node {node}")]
    Get {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[cfg(feature = "kube")]
    #[error("labelling Node {node}")]
    Patch {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("no access to the Kubernetes API")]
    NoClient,
}

kvpool_runtime::error_category!(NodeError);

/// Metrics of the agent's use of its Node object.
#[derive(Clone, Debug)]
pub struct NodeMetrics {
    /// 1 while the pool spreads by a node label this node does not carry (or that could not
    /// be read): the agent announces no failure domain.
    pub failure_domain_missing: IntGauge,
    /// Failed API calls, by `operation` (`config`, `get`, `patch`).
    pub api_errors: IntCounterVec,
}

impl NodeMetrics {
    /// Create the metrics and register them into `registry`.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        Ok(Self {
            failure_domain_missing: gauge(
                registry,
                "kvpool_agent_failure_domain_missing",
                "1 when the node lacks the pool's spread label (or it could not be read): the \
                 agent announces no failure domain",
            )?,
            api_errors: counters(
                registry,
                "kvpool_agent_node_api_errors_total",
                "Failed Kubernetes API calls about the agent's own Node object",
                &["operation"],
            )?,
        })
    }

    fn count(&self, e: &NodeError) {
        let op = match e {
            #[cfg(feature = "kube")]
            NodeError::Config(_) => "config",
            NodeError::NoClient => "config",
            #[cfg(feature = "kube")]
            NodeError::Get { .. } => "get",
            #[cfg(feature = "kube")]
            NodeError::Patch { .. } => "patch",
        };
        self.api_errors.with_label_values(&[op]).inc();
    }
}

/// The part of a Node object the agent reads: its metadata (labels). The rest (spec, status
/// with its images, conditions and addresses) is skipped while decoding the replies to the get
/// and the patch, so the agent carries no decoder for the whole Node.
#[derive(kube::Resource, Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[resource(inherit = "Node")]
pub struct NodeMeta {
    pub metadata: ObjectMeta,
}

/// This node's object through the API server.
#[cfg(feature = "kube")]
#[derive(Clone)]
pub struct NodeClient {
    api: Api<NodeMeta>,
    node: String,
}

/// Built without the `kube` feature there is no client: [`client_for`] never makes one.
#[cfg(not(feature = "kube"))]
#[derive(Clone)]
pub enum NodeClient {}

#[cfg(not(feature = "kube"))]
impl NodeClient {
    async fn labels(&self) -> Result<BTreeMap<String, String>, NodeError> {
        match *self {}
    }

    async fn publish_topology(&self, _: &NodeSummary) -> Result<(), NodeError> {
        match *self {}
    }
}

#[cfg(feature = "kube")]
impl NodeClient {
    /// A client for node `node` over `client`.
    pub fn new(client: kube::Client, node: &str) -> Self {
        Self {
            api: Api::all(client),
            node: node.to_owned(),
        }
    }

    /// A client from the pod's service account (or a kubeconfig outside a cluster).
    pub async fn connect(node: &str) -> Result<Self, NodeError> {
        let client = kube::Client::try_default()
            .await
            .map_err(NodeError::Config)?;
        Ok(Self::new(client, node))
    }

    /// The node's labels.
    pub async fn labels(&self) -> Result<BTreeMap<String, String>, NodeError> {
        let node = self
            .api
            .get(&self.node)
            .await
            .map_err(|source| NodeError::Get {
                node: self.node.clone(),
                source,
            })?;
        Ok(node.metadata.labels.unwrap_or_default())
    }

    /// Merge-patch the topology labels and annotations of `summary` onto the node (other
    /// labels are left alone).
    pub async fn publish_topology(&self, summary: &NodeSummary) -> Result<(), NodeError> {
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        };
        self.api
            .patch(&self.node, &params, &Patch::Merge(topology_patch(summary)))
            .await
            .map_err(|source| NodeError::Patch {
                node: self.node.clone(),
                source,
            })?;
        Ok(())
    }
}

/// The JSON merge patch that puts `summary` on a Node object.
pub fn topology_patch(summary: &NodeSummary) -> serde_json::Value {
    serde_json::json!({
        "metadata": {
            "labels": summary.labels,
            "annotations": summary.annotations,
        }
    })
}

/// This node's failure domain: the configured one, else the value of `label` among the node's
/// `labels` (for [`HOSTNAME_LABEL`], the node's name). `Err` says why there is none when the
/// pool spreads by a label.
pub fn choose_failure_domain(
    configured: Option<&str>,
    label: Option<&str>,
    node_name: &str,
    labels: Result<&BTreeMap<String, String>, &NodeError>,
) -> Result<String, String> {
    if let Some(d) = configured {
        return Ok(d.to_owned());
    }
    let Some(key) = label else {
        return Ok(String::new());
    };
    if key == HOSTNAME_LABEL {
        return Ok(node_name.to_owned());
    }
    match labels {
        Ok(labels) => match labels.get(key).map(|v| v.trim()) {
            Some(v) if !v.is_empty() => Ok(v.to_owned()),
            _ => Err(format!("the node has no label {key}")),
        },
        Err(e) => Err(format!("the node's labels could not be read: {e}")),
    }
}

/// What the agent does with its Node object before it announces segments: publish the
/// topology (when asked) and find the failure domain. A problem is logged and counted; the
/// domain is then empty (replicas still go to distinct nodes).
pub async fn prepare(
    cfg: &AgentConfig,
    summary: &NodeSummary,
    client: Option<&NodeClient>,
    metrics: &NodeMetrics,
) -> String {
    let configured = cfg.pool.as_ref().and_then(|p| p.failure_domain.as_deref());
    let label = cfg.kubernetes.failure_domain_label.as_deref();
    if cfg.kubernetes.publish_topology
        && let Some(c) = client
    {
        match c.publish_topology(summary).await {
            Ok(()) => tracing::info!(node = %cfg.node_name, labels = ?summary.labels,
                "topology labels published on the node"),
            Err(e) => {
                metrics.count(&e);
                tracing::warn!(node = %cfg.node_name, error = %e, source = ?std::error::Error::source(&e),
                    "cannot label the node with its topology (RBAC: patch nodes)");
            }
        }
    }
    let labels = match (configured, label, client) {
        (None, Some(key), Some(c)) if key != HOSTNAME_LABEL => {
            c.labels().await.inspect_err(|e| metrics.count(e))
        }
        (None, Some(key), None) if key != HOSTNAME_LABEL => Err(NodeError::NoClient),
        _ => Ok(BTreeMap::new()),
    };
    match choose_failure_domain(configured, label, &cfg.node_name, labels.as_ref()) {
        Ok(domain) => {
            metrics.failure_domain_missing.set(0);
            tracing::info!(node = %cfg.node_name, failure_domain = %domain, "failure domain");
            domain
        }
        Err(why) => {
            metrics.failure_domain_missing.set(1);
            tracing::warn!(node = %cfg.node_name, label = label.unwrap_or_default(),
                "{why}: announcing no failure domain (replicas are kept on distinct nodes only)");
            String::new()
        }
    }
}

/// The client [`prepare`] needs for `cfg`, if any: `None` when the agent does not use the API
/// server, or the configuration settles the failure domain and nothing is published. Without
/// API access (no ServiceAccount token: the pool names no `agent.serviceAccountName`) the
/// topology is not published, which is logged; when the failure domain depended on it, that
/// is a warning and counted.
pub async fn client_for(cfg: &AgentConfig, metrics: &NodeMetrics) -> Option<NodeClient> {
    let configured = cfg
        .pool
        .as_ref()
        .is_some_and(|p| p.failure_domain.is_some());
    let needs_labels = cfg.kubernetes.needs_node_labels(configured);
    if !cfg.kubernetes.needs_api(configured) {
        return None;
    }
    connect(cfg, needs_labels, metrics).await
}

/// Built without the `kube` feature: no client (`config::validate` refused a configuration
/// that needs one, so this is not reached from the agent's own start-up).
#[cfg(not(feature = "kube"))]
async fn connect(_: &AgentConfig, _: bool, _: &NodeMetrics) -> Option<NodeClient> {
    tracing::warn!(
        "the agent's Node object {}",
        crate::config::kubernetes::NO_KUBE
    );
    None
}

/// A client for the node of `cfg`; its absence is a warning when `needs_labels`.
#[cfg(feature = "kube")]
async fn connect(
    cfg: &AgentConfig,
    needs_labels: bool,
    metrics: &NodeMetrics,
) -> Option<NodeClient> {
    match NodeClient::connect(&cfg.node_name).await {
        Ok(c) => Some(c),
        Err(e) if needs_labels => {
            metrics.count(&e);
            tracing::warn!(error = %e, source = ?std::error::Error::source(&e),
                "no Kubernetes API: the node's failure domain cannot be read");
            None
        }
        Err(e) => {
            tracing::info!(error = %e,
                "no Kubernetes API (the pool names no agent.serviceAccountName): topology labels not published");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configured_domain_wins_then_the_label_then_none() {
        let labels: BTreeMap<String, String> = [
            ("topology.kubernetes.io/zone".to_owned(), "z1".to_owned()),
            ("rack".to_owned(), " ".to_owned()),
        ]
        .into();
        let zone = Some("topology.kubernetes.io/zone");
        let choose = |c, l, ls| choose_failure_domain(c, l, "node-1", ls);
        assert_eq!(choose(Some("r7"), zone, Ok(&labels)), Ok("r7".into()));
        assert_eq!(choose(None, zone, Ok(&labels)), Ok("z1".into()));
        assert_eq!(choose(None, None, Ok(&labels)), Ok(String::new()));
        let missing = choose(None, Some("rack"), Ok(&labels)).expect_err("blank");
        assert!(missing.contains("no label rack"), "{missing}");
        let unreadable = choose(None, zone, Err(&NodeError::NoClient)).expect_err("error");
        assert!(unreadable.contains("could not be read"), "{unreadable}");
        // The hostname label is the node's name, with or without API access.
        assert_eq!(
            choose(None, Some(HOSTNAME_LABEL), Err(&NodeError::NoClient)),
            Ok("node-1".into())
        );
    }

    #[test]
    fn the_patch_carries_labels_and_annotations_only() {
        let summary = NodeSummary {
            labels: [("kvpool.dev/gpus".to_owned(), "8".to_owned())].into(),
            annotations: [("kvpool.dev/discovery-warnings".to_owned(), "0".to_owned())].into(),
        };
        assert_eq!(
            topology_patch(&summary),
            serde_json::json!({"metadata": {
                "labels": {"kvpool.dev/gpus": "8"},
                "annotations": {"kvpool.dev/discovery-warnings": "0"},
            }})
        );
    }

    #[test]
    fn metrics_register_once() {
        let registry = Registry::new();
        let m = NodeMetrics::new(&registry).expect("metrics");
        m.count(&NodeError::NoClient);
        assert_eq!(m.api_errors.with_label_values(&["config"]).get(), 1);
        assert!(NodeMetrics::new(&registry).is_err(), "names are taken");
    }
}
