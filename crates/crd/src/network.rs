//! The network side of a `KVCachePool` spec: whether the operator renders the pool's
//! NetworkPolicies and which peers outside the pool they admit (callers of the conductor,
//! scrapers of the admin ports), and the rule that keeps `ssd.hostPath` under the directories a
//! cluster lends to the pool. Pure types and checks, no I/O.

use k8s_openapi::api::networking::v1::NetworkPolicyPeer;
use schemars::JsonSchema;
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
    let Some(rest) = SSD_HOST_PATH_PREFIXES
        .iter()
        .find_map(|prefix| path.strip_prefix(prefix))
    else {
        return false;
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    !rest.is_empty()
        && rest
            .split('/')
            .all(|seg| !seg.is_empty() && seg != "." && seg != "..")
}

/// The pool's NetworkPolicies (one each for the master, the agents and the conductor). They
/// admit ingress only; egress is left open.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
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
    pub conductor_from: Vec<NetworkPolicyPeer>,

    /// Who may scrape the admin port (`/metrics`) of the master, agents and conductor, e.g. a
    /// namespaceSelector of the monitoring namespace with a podSelector of Prometheus. Empty:
    /// only the pool's own pods (the kubelet's probes come from the node and are not affected by
    /// most network plugins).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub metrics_from: Vec<NetworkPolicyPeer>,
}

impl Default for NetworkPolicySpec {
    fn default() -> Self {
        Self {
            enabled: defaults::enabled(),
            conductor_from: Vec::new(),
            metrics_from: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
