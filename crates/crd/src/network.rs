//! The network side of a `KVCachePool` spec: whether the operator renders the pool's
//! NetworkPolicies and which peers outside the pool they admit (callers of the conductor,
//! scrapers of the admin ports), and the rule that keeps `ssd.hostPath` under the directories a
//! cluster lends to the pool. Pure types and checks, no I/O.

use k8s_openapi::api::networking::v1::{IPBlock, NetworkPolicyPeer};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use super::defaults;

/// Directories below which `ssd.hostPath` may lie. The agent mounts that directory read-write
/// on every node of the pool, so it must be one set aside for data, never a system directory.
pub const SSD_HOST_PATH_PREFIXES: [&str; 3] = ["/mnt/", "/data/", "/var/lib/kvpool/"];

/// Message of the `ssd.hostPath` rule, the same in CEL and in Rust.
pub const SSD_HOST_PATH_MESSAGE: &str = "ssd.hostPath must be a directory below /mnt/, /data/ or /var/lib/kvpool/ with no '.', '..' or empty segments (the agent mounts it read-write on every node)";

/// The CEL rule of `ssd.hostPath` (see [`ssd_host_path_allowed`], its Rust twin).
pub const SSD_HOST_PATH_RULE: &str = "self.matches('^/(mnt|data|var/lib/kvpool)/[^/]+(/[^/]+)*/?$') && !self.matches('/[.][.]?(/|$)')";

/// Whether `path` is an allowed SSD directory: below one of [`SSD_HOST_PATH_PREFIXES`], at
/// least one segment below it, no empty (`//`), `.` or `..` segment; one trailing `/` is fine.
pub fn ssd_host_path_allowed(path: &str) -> bool {
    host_path_below(&SSD_HOST_PATH_PREFIXES, path)
}

/// Whether `path` lies below one of `prefixes` (each ending in `/`), at least one segment below
/// it, with no empty (`//`), `.` or `..` segment; one trailing `/` is fine.
pub(crate) fn host_path_below(prefixes: &[&str], path: &str) -> bool {
    let Some(rest) = prefixes.iter().find_map(|prefix| path.strip_prefix(prefix)) else {
        return false;
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    !rest.is_empty()
        && rest
            .split('/')
            .all(|seg| !seg.is_empty() && seg != "." && seg != "..")
}

/// Message of the rule on each `networkPolicy.conductorFrom` peer.
pub const CONDUCTOR_PEER_MESSAGE: &str = "networkPolicy.conductorFrom: each peer sets either ipBlock or podSelector and/or namespaceSelector";
/// Message of the rule on each `networkPolicy.engineFrom` peer.
pub const ENGINE_PEER_MESSAGE: &str = "networkPolicy.engineFrom: each peer sets either ipBlock or podSelector and/or namespaceSelector";
/// Message of the rule on each `networkPolicy.metricsFrom` peer.
pub const METRICS_PEER_MESSAGE: &str = "networkPolicy.metricsFrom: each peer sets either ipBlock or podSelector and/or namespaceSelector";

/// A peer type of one list: the same fields as a NetworkPolicy's `from` entry, and a CEL rule
/// whose message names that list (so `kubectl apply` points at it).
macro_rules! peer_type {
    ($(#[$doc:meta])* $name:ident, $message:literal) => {
        $(#[$doc])*
        #[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
        #[serde(rename_all = "camelCase")]
        #[x_kube(validation = Rule::new("has(self.ipBlock) != (has(self.podSelector) || has(self.namespaceSelector))").message($message).reason(Reason::FieldValueInvalid))]
        pub struct $name {
            /// Pods with these labels (in the pool's namespace unless `namespaceSelector` is
            /// set).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub pod_selector: Option<LabelSelector>,
            /// Namespaces with these labels (every pod there unless `podSelector` is set).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub namespace_selector: Option<LabelSelector>,
            /// A CIDR, with exceptions.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub ip_block: Option<IPBlock>,
        }

        impl $name {
            /// Whether the API server accepts the peer: an `ipBlock`, or selectors, not both
            /// and not neither (the Rust twin of the CEL rule).
            pub fn is_valid(&self) -> bool {
                self.ip_block.is_some()
                    != (self.pod_selector.is_some() || self.namespace_selector.is_some())
            }
        }

        impl From<&$name> for NetworkPolicyPeer {
            fn from(p: &$name) -> Self {
                NetworkPolicyPeer {
                    pod_selector: p.pod_selector.clone(),
                    namespace_selector: p.namespace_selector.clone(),
                    ip_block: p.ip_block.clone(),
                }
            }
        }
    };
}

peer_type!(
    /// A caller the conductor's policy admits to its HTTP port: pods chosen by `podSelector` (in
    /// the pool's namespace, or in the namespaces `namespaceSelector` chooses), or `ipBlock`.
    ConductorPeer,
    "networkPolicy.conductorFrom: each peer sets either ipBlock or podSelector and/or namespaceSelector"
);
peer_type!(
    /// A caller the engine pods' policy admits to their API port directly: pods chosen by
    /// `podSelector` (in the pool's namespace, or in the namespaces `namespaceSelector`
    /// chooses), or `ipBlock`.
    EnginePeer,
    "networkPolicy.engineFrom: each peer sets either ipBlock or podSelector and/or namespaceSelector"
);
peer_type!(
    /// A scraper the pool's policies admit to the admin ports: pods chosen by `podSelector` (in
    /// the pool's namespace, or in the namespaces `namespaceSelector` chooses), or `ipBlock`.
    MetricsPeer,
    "networkPolicy.metricsFrom: each peer sets either ipBlock or podSelector and/or namespaceSelector"
);

/// The pool's NetworkPolicies (one each for the master, the agents and the conductor, and one
/// for the pods of each Prefill- or DecodePool on the pool). They admit ingress only; egress is
/// left open.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicySpec {
    /// Render the NetworkPolicies. Turn off where the cluster's network plugin enforces none or
    /// where the platform manages policies itself.
    #[serde(default = "defaults::enabled")]
    pub enabled: bool,

    /// Who may call the conductor's HTTP port (the OpenAI-compatible front door). Empty: every
    /// pod in the pool's namespace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub conductor_from: Vec<ConductorPeer>,

    /// Who may call the engines' API port directly, besides the pool's own pods (its agents,
    /// master, conductor and engines). Empty: nobody else when the pool runs a conductor
    /// (clients go through it, and its admission control), every pod in the pool's namespace
    /// when it runs none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub engine_from: Vec<EnginePeer>,

    /// Who may scrape the admin port (`/metrics`) of the master, agents and conductor (and the
    /// engines' API port, where they serve theirs), e.g. a
    /// namespaceSelector of the monitoring namespace with a podSelector of Prometheus. Empty:
    /// only the pool's own pods (the kubelet's probes come from the node and are not affected by
    /// most network plugins).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub metrics_from: Vec<MetricsPeer>,
}

impl Default for NetworkPolicySpec {
    fn default() -> Self {
        Self {
            enabled: defaults::enabled(),
            conductor_from: Vec::new(),
            engine_from: Vec::new(),
            metrics_from: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_is_an_ip_block_or_selectors() {
        let selector = Some(LabelSelector::default());
        let block = Some(IPBlock {
            cidr: "10.0.0.0/8".to_owned(),
            except: None,
        });
        let peer = |pod, ns, ip| MetricsPeer {
            pod_selector: pod,
            namespace_selector: ns,
            ip_block: ip,
        };
        assert!(peer(selector.clone(), None, None).is_valid());
        assert!(peer(None, selector.clone(), None).is_valid());
        assert!(peer(selector.clone(), selector.clone(), None).is_valid());
        assert!(peer(None, None, block.clone()).is_valid());
        assert!(!peer(None, None, None).is_valid());
        assert!(!peer(selector.clone(), None, block.clone()).is_valid());
        assert!(!peer(None, selector, block).is_valid());
        // The messages the CEL rules carry are the constants the tests name.
        let schema = serde_json::to_value(schemars::schema_for!(NetworkPolicySpec)).expect("json");
        let text = schema.to_string();
        assert!(text.contains(CONDUCTOR_PEER_MESSAGE) && text.contains(METRICS_PEER_MESSAGE));
    }

    #[test]
    fn ssd_host_path_accepts_data_directories_only() {
        for ok in [
            "/mnt/nvme",
            "/mnt/nvme/kvpool/",
            "/data/kv",
            "/var/lib/kvpool/ssd",
            "/mnt/.hidden",
            "/mnt/a..b",
        ] {
            assert!(ssd_host_path_allowed(ok), "{ok}");
        }
        for bad in [
            "/",
            "/mnt",
            "/mnt/",
            "/etc",
            "/etc/kvpool",
            "/var/lib/kubelet",
            "/var/lib/kvpool",
            "//mnt/nvme",
            "/mnt//nvme",
            "/mnt/nvme/..",
            "/mnt/../etc",
            "/mnt/./nvme",
            "/data/x//",
            "mnt/nvme",
            "/mntx/nvme",
        ] {
            assert!(!ssd_host_path_allowed(bad), "{bad}");
        }
    }
}
