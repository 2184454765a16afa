//! Label and annotation keys that the operator puts on the children of kvpool resources and that
//! the agent, master and dashboards select on. Pure constants and label-map builders, no I/O.

use std::collections::BTreeMap;

/// `app.kubernetes.io/name`: always [`APP_NAME_VALUE`].
pub const APP_NAME: &str = "app.kubernetes.io/name";
/// `kvpool.dev/instance`: name of the custom resource that owns the object. Not
/// `app.kubernetes.io/instance`: Argo CD's label tracking reads that label as the name of the
/// Argo CD Application an object belongs to, so children carrying their pool's name there
/// would be taken for (and pruned from) an Application of that name.
pub const INSTANCE: &str = "kvpool.dev/instance";
/// `app.kubernetes.io/component`: same value as [`COMPONENT`].
pub const APP_COMPONENT: &str = "app.kubernetes.io/component";
/// `app.kubernetes.io/part-of`: always [`APP_NAME_VALUE`].
pub const APP_PART_OF: &str = "app.kubernetes.io/part-of";
/// `app.kubernetes.io/managed-by`: always [`MANAGED_BY_VALUE`].
pub const APP_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// `kvpool.dev/pool`: name of the KVCachePool the object belongs to (for engines: the pool
/// their `kvCachePoolRef` names).
pub const POOL: &str = "kvpool.dev/pool";
/// `kvpool.dev/component`: which part of kvpool the object is (see [`Component`]).
pub const COMPONENT: &str = "kvpool.dev/component";

/// Value of `app.kubernetes.io/name` and `app.kubernetes.io/part-of`.
pub const APP_NAME_VALUE: &str = "kvpool";
/// Value of `app.kubernetes.io/managed-by` on everything the operator creates.
pub const MANAGED_BY_VALUE: &str = "kvpool-operator";

/// `kvpool.dev/engine-protocol` on engine pods: the disaggregated-serving convention the
/// engine speaks (`vllm`, `vllm-mooncake` or `sglang`); the conductor routes each pair by it.
/// Engine pools of `kind: custom` carry none unless their `spec.template` sets it, and get the
/// conductor's `--engine-protocol`.
pub const ENGINE_PROTOCOL_ANNOTATION: &str = "kvpool.dev/engine-protocol";
/// `kvpool.dev/bootstrap-port` on SGLang and vLLM `MooncakeConnector` engine pods: the prefill
/// engine's bootstrap server port (SGLang's `--disaggregation-bootstrap-port`, vLLM's
/// `VLLM_MOONCAKE_BOOTSTRAP_PORT`).
pub const BOOTSTRAP_PORT_ANNOTATION: &str = "kvpool.dev/bootstrap-port";
/// SGLang's default `--disaggregation-bootstrap-port` (and vLLM's default
/// `VLLM_MOONCAKE_BOOTSTRAP_PORT`).
pub const SGLANG_DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// Multus annotation listing the extra networks of a pod.
pub const MULTUS_NETWORKS_ANNOTATION: &str = "k8s.v1.cni.cncf.io/networks";

/// The parts of a kvpool deployment, as written in [`COMPONENT`] labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Component {
    /// Node agent DaemonSet.
    Agent,
    /// Metadata service.
    Master,
    /// Scheduler and front door.
    Conductor,
    /// Prefill engines.
    Prefill,
    /// Decode engines.
    Decode,
}

impl Component {
    /// Every component, in a fixed order.
    pub const ALL: [Self; 5] = [
        Self::Agent,
        Self::Master,
        Self::Conductor,
        Self::Prefill,
        Self::Decode,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Agent => "agent",
            Self::Master => "master",
            Self::Conductor => "conductor",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }

    /// Parses a label value.
    pub fn from_label(value: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == value)
    }
}

impl std::fmt::Display for Component {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl AsRef<str> for Component {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

/// The labels that select one component of one owner: stable for the owner's lifetime, so they
/// can be a Deployment's or DaemonSet's `spec.selector` (which is immutable). The component is a
/// [`Component`] or its [`COMPONENT`] label value: the operator also labels children that run
/// nothing (a pool's ConfigMap and Secret), which no [`Component`] names.
pub fn selector_labels(
    kv_cache_pool: &str,
    instance: &str,
    component: impl AsRef<str>,
) -> BTreeMap<String, String> {
    BTreeMap::from([
        (APP_NAME.to_owned(), APP_NAME_VALUE.to_owned()),
        (INSTANCE.to_owned(), instance.to_owned()),
        (POOL.to_owned(), kv_cache_pool.to_owned()),
        (COMPONENT.to_owned(), component.as_ref().to_owned()),
    ])
}

/// All labels the operator puts on a child: the selector labels plus `component`, `part-of` and
/// `managed-by`.
pub fn common_labels(
    kv_cache_pool: &str,
    instance: &str,
    component: impl AsRef<str>,
) -> BTreeMap<String, String> {
    let mut labels = selector_labels(kv_cache_pool, instance, component.as_ref());
    labels.insert(APP_COMPONENT.to_owned(), component.as_ref().to_owned());
    labels.insert(APP_PART_OF.to_owned(), APP_NAME_VALUE.to_owned());
    labels.insert(APP_MANAGED_BY.to_owned(), MANAGED_BY_VALUE.to_owned());
    labels
}

/// Renders labels as a selector string (`k=v,k2=v2`, keys sorted), as the scale subresource's
/// `status.selector` and `kubectl -l` take it.
pub fn selector_string(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn component_labels_round_trip() {
        for c in Component::ALL {
            assert_eq!(Component::from_label(c.as_str()), Some(c));
        }
        assert_eq!(Component::from_label("engine"), None);
    }

    #[test]
    fn common_labels_contain_selector_labels() {
        let sel = selector_labels("cache", "cache", Component::Agent);
        let all = common_labels("cache", "cache", Component::Agent);
        for (k, v) in &sel {
            assert_eq!(all.get(k), Some(v), "{k}");
        }
        assert_eq!(
            all.get(APP_MANAGED_BY).map(String::as_str),
            Some("kvpool-operator")
        );
        assert_eq!(all.len(), sel.len() + 3);
    }

    #[test]
    fn selector_string_is_sorted_and_comma_separated() {
        let sel = selector_labels("cache", "prefill-a", Component::Prefill);
        assert_eq!(
            selector_string(&sel),
            "app.kubernetes.io/name=kvpool,kvpool.dev/component=prefill,\
             kvpool.dev/instance=prefill-a,kvpool.dev/pool=cache"
        );
    }
}
