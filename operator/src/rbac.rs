//! Every (API group, resource, verb) the operator uses, in one list, so that the chart's
//! ClusterRole can be tested to grant exactly these and nothing more. Keep it in step with the
//! code: each entry names the call that needs it. I/O boundary: none (pure data).

/// One permission: API group ("" for core), resource (with `/subresource`), verb.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Permission {
    pub group: &'static str,
    pub resource: &'static str,
    pub verb: &'static str,
}

const fn p(group: &'static str, resource: &'static str, verb: &'static str) -> Permission {
    Permission {
        group,
        resource,
        verb,
    }
}

/// The full list, grouped by what needs it.
pub const PERMISSIONS: &[Permission] = &[
    // The event recorder creates Events (InvalidSpec warnings, the autoscaling ScaledUp and
    // ScaledDown) and patches them to bump a series. Autoscaling writes no */scale: the count
    // goes to the engine Deployment (docs/adr/0007-autoscaling-from-the-conductor.md).
    p("events.k8s.io", "events", "create"),
    p("events.k8s.io", "events", "patch"),
    // Children: server-side apply (patch; create when absent), owned watches (list, watch),
    // orphan removal (list by label, delete).
    p("", "configmaps", "create"),
    p("", "configmaps", "delete"),
    p("", "configmaps", "list"),
    p("", "configmaps", "patch"),
    p("", "configmaps", "watch"),
    // The auth Secret is created once and never read, patched or watched: the operator derives
    // the pool key from its root key (docs/adr/0008-operator-root-key.md).
    p("", "secrets", "create"),
    // Engine discovery: the conductor's Role lets it list and watch pods, and RBAC only lets
    // the operator grant what it holds itself. The operator never reads pods.
    p("", "pods", "list"),
    p("", "pods", "watch"),
    // The conductor's ServiceAccount (and below its Role and RoleBinding): server-side apply,
    // removal by label when the conductor is turned off.
    p("", "serviceaccounts", "create"),
    p("", "serviceaccounts", "delete"),
    p("", "serviceaccounts", "list"),
    p("", "serviceaccounts", "patch"),
    p("", "services", "create"),
    p("", "services", "delete"),
    p("", "services", "list"),
    p("", "services", "patch"),
    p("", "services", "watch"),
    p("apps", "daemonsets", "create"),
    p("apps", "daemonsets", "delete"),
    p("apps", "daemonsets", "list"),
    p("apps", "daemonsets", "patch"),
    p("apps", "daemonsets", "watch"),
    p("apps", "deployments", "create"),
    p("apps", "deployments", "delete"),
    p("apps", "deployments", "list"),
    p("apps", "deployments", "patch"),
    p("apps", "deployments", "watch"),
    // Leader election (kube-lease-manager): read, create when absent, take/renew by apply.
    p("coordination.k8s.io", "leases", "create"),
    p("coordination.k8s.io", "leases", "get"),
    p("coordination.k8s.io", "leases", "patch"),
    // The three kinds: watched by the controllers, a KVCachePool is read when a Prefill or
    // DecodePool is reconciled, and status is written through the status subresource.
    p("kvpool.dev", "decodepools", "get"),
    p("kvpool.dev", "decodepools", "list"),
    p("kvpool.dev", "decodepools", "watch"),
    p("kvpool.dev", "decodepools/status", "patch"),
    p("kvpool.dev", "kvcachepools", "get"),
    p("kvpool.dev", "kvcachepools", "list"),
    p("kvpool.dev", "kvcachepools", "watch"),
    p("kvpool.dev", "kvcachepools/status", "patch"),
    p("kvpool.dev", "prefillpools", "get"),
    p("kvpool.dev", "prefillpools", "list"),
    p("kvpool.dev", "prefillpools", "watch"),
    p("kvpool.dev", "prefillpools/status", "patch"),
    // The pool's NetworkPolicies: server-side apply, removal by label when turned off. Not
    // watched (drift is corrected at the next resync).
    p("networking.k8s.io", "networkpolicies", "create"),
    p("networking.k8s.io", "networkpolicies", "delete"),
    p("networking.k8s.io", "networkpolicies", "list"),
    p("networking.k8s.io", "networkpolicies", "patch"),
    p("rbac.authorization.k8s.io", "rolebindings", "create"),
    p("rbac.authorization.k8s.io", "rolebindings", "delete"),
    p("rbac.authorization.k8s.io", "rolebindings", "list"),
    p("rbac.authorization.k8s.io", "rolebindings", "patch"),
    p("rbac.authorization.k8s.io", "roles", "create"),
    p("rbac.authorization.k8s.io", "roles", "delete"),
    p("rbac.authorization.k8s.io", "roles", "list"),
    p("rbac.authorization.k8s.io", "roles", "patch"),
];

/// With `--root-key-secret`, in the operator's own namespace only: reading its root key
/// Secret (the chart limits `get` to that one name with `resourceNames`) and creating it when
/// absent (`operator/src/root_key_secret.rs`).
pub const ROOT_KEY_PERMISSIONS: &[Permission] =
    &[p("", "secrets", "create"), p("", "secrets", "get")];

/// With `--agent-issuer-url`: the agent credential issuer reads the calling agent's pod and
/// the pool's agent DaemonSet by name (`operator/src/issuer/serve.rs`), in the watched
/// namespaces like the rest.
pub const AGENT_ISSUER_PERMISSIONS: &[Permission] =
    &[p("", "pods", "get"), p("apps", "daemonsets", "get")];

/// With `--agent-issuer-url`, cluster-wide (a TokenReview has no namespace): asking the API
/// server whether an agent's token is valid. The chart grants it in a ClusterRole of its own.
pub const AGENT_ISSUER_CLUSTER_PERMISSIONS: &[Permission] =
    &[p("authentication.k8s.io", "tokenreviews", "create")];

/// [`AGENT_ISSUER_PERMISSIONS`] and [`AGENT_ISSUER_CLUSTER_PERMISSIONS`] as tuples.
pub fn agent_issuer_permissions() -> Vec<(&'static str, &'static str, &'static str)> {
    AGENT_ISSUER_PERMISSIONS
        .iter()
        .chain(AGENT_ISSUER_CLUSTER_PERMISSIONS)
        .map(|p| (p.group, p.resource, p.verb))
        .collect()
}

/// The permissions as `(group, resource, verb)` tuples, for tests outside this crate.
pub fn permissions() -> Vec<(&'static str, &'static str, &'static str)> {
    PERMISSIONS
        .iter()
        .map(|p| (p.group, p.resource, p.verb))
        .collect()
}

/// [`ROOT_KEY_PERMISSIONS`] as tuples.
pub fn root_key_permissions() -> Vec<(&'static str, &'static str, &'static str)> {
    ROOT_KEY_PERMISSIONS
        .iter()
        .map(|p| (p.group, p.resource, p.verb))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_is_sorted_and_free_of_duplicates_and_wildcards() {
        let mut sorted = PERMISSIONS.to_vec();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), PERMISSIONS.len(), "duplicates in PERMISSIONS");
        assert!(
            PERMISSIONS
                .iter()
                .all(|p| p.verb != "*" && p.resource != "*")
        );
    }
}
