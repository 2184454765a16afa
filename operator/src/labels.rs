//! Names, labels and owner references of the children: deterministic names derived from the
//! owner's name, the common `app.kubernetes.io/*` labels, and the `kvpool.dev/*` labels by
//! which orphans are found. I/O boundary: none.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

/// Field manager of every server-side apply the operator makes.
pub const FIELD_MANAGER: &str = "kvpool-operator";

pub use kvpool_crd::labels::{
    APP_COMPONENT, APP_MANAGED_BY, APP_NAME, APP_NAME_VALUE, APP_PART_OF,
    BOOTSTRAP_PORT_ANNOTATION, COMPONENT, ENGINE_PROTOCOL_ANNOTATION, MANAGED_BY_VALUE, POOL,
};
/// Kind of the kvpool resource that owns a child.
pub const OWNER_KIND: &str = "kvpool.dev/owner-kind";
/// Name of the kvpool resource that owns a child.
pub const OWNER_NAME: &str = "kvpool.dev/owner-name";
/// Pod-template annotation with a hash of the mounted config, so pods roll when it changes.
pub const CONFIG_HASH: &str = "kvpool.dev/config-hash";
/// Multus annotation naming the secondary networks of a pod.
pub const MULTUS_NETWORKS: &str = kvpool_crd::labels::MULTUS_NETWORKS_ANNOTATION;

/// The longest name of a resource whose children get the longest suffix (`-conductor`), so that
/// every child name is a valid DNS-1035 label (63 characters).
pub const MAX_OWNER_NAME_LEN: usize = 63 - "-conductor".len();

/// Components of a pool, one per kind of child.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Component {
    Agent,
    Master,
    Conductor,
    Config,
    Auth,
    Prefill,
    Decode,
}

impl Component {
    pub fn as_str(self) -> &'static str {
        match self {
            Component::Agent => "agent",
            Component::Master => "master",
            Component::Conductor => "conductor",
            Component::Config => "config",
            Component::Auth => "auth",
            Component::Prefill => "prefill",
            Component::Decode => "decode",
        }
    }
}

/// Deterministic child name: `<owner>-<component>`.
pub fn child_name(owner: &str, component: Component) -> String {
    format!("{owner}-{}", component.as_str())
}

/// Labels that select the pods of one component of one owner (stable: used in selectors).
/// The shape of `kvpool_crd::labels::selector_labels`: name, instance, pool, component.
pub fn selector_labels(pool: &str, owner: &str, component: Component) -> BTreeMap<String, String> {
    kvpool_crd::labels::selector_labels(pool, owner, component.as_str())
}

/// All labels of a child: the selector labels, the common `app.kubernetes.io` labels and the
/// ownership labels by which orphans are found.
pub fn child_labels(
    owner_kind: &str,
    owner: &str,
    pool: &str,
    component: Component,
) -> BTreeMap<String, String> {
    let mut labels = kvpool_crd::labels::common_labels(pool, owner, component.as_str());
    labels.insert(OWNER_KIND.to_owned(), owner_kind.to_owned());
    labels.insert(OWNER_NAME.to_owned(), owner.to_owned());
    labels
}

/// Label selector matching every child of one owner (used to find orphans).
pub fn owner_selector(owner_kind: &str, owner: &str) -> String {
    format!("{APP_MANAGED_BY}={MANAGED_BY_VALUE},{OWNER_KIND}={owner_kind},{OWNER_NAME}={owner}")
}

/// Label selector for the owned-object watches: everything this operator manages.
pub fn managed_selector() -> String {
    format!("{APP_MANAGED_BY}={MANAGED_BY_VALUE}")
}

/// Metadata of a child: name, namespace, labels and the controller owner reference.
pub fn child_meta(
    name: String,
    namespace: &str,
    labels: BTreeMap<String, String>,
    owner: &OwnerReference,
) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(namespace.to_owned()),
        labels: Some(labels),
        owner_references: Some(vec![owner.clone()]),
        ..ObjectMeta::default()
    }
}

/// Stable hex hash of some bytes (xxh3, 64 bits) for the config-hash annotation.
pub fn content_hash(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_selectors_are_deterministic() {
        assert_eq!(child_name("pool-a", Component::Master), "pool-a-master");
        let labels = child_labels("KVCachePool", "pool-a", "pool-a", Component::Agent);
        assert_eq!(labels[APP_COMPONENT], "agent");
        assert_eq!(labels[OWNER_KIND], "KVCachePool");
        for (k, v) in selector_labels("pool-a", "pool-a", Component::Agent) {
            assert_eq!(
                labels[&k], v,
                "selector label {k} missing from child labels"
            );
        }
        assert_eq!(
            owner_selector("PrefillPool", "p"),
            "app.kubernetes.io/managed-by=kvpool-operator,kvpool.dev/owner-kind=PrefillPool,kvpool.dev/owner-name=p"
        );
        assert_eq!(MAX_OWNER_NAME_LEN, 53);
        // The workload labels match the shared definitions in kvpool_crd::labels.
        use kvpool_crd::labels as shared;
        for (mine, theirs) in [
            (Component::Agent, shared::Component::Agent),
            (Component::Master, shared::Component::Master),
            (Component::Conductor, shared::Component::Conductor),
            (Component::Prefill, shared::Component::Prefill),
            (Component::Decode, shared::Component::Decode),
        ] {
            assert_eq!(
                selector_labels("cache", "inst", mine),
                shared::selector_labels("cache", "inst", theirs)
            );
            let mut common = shared::common_labels("cache", "inst", theirs);
            common.insert(OWNER_KIND.to_owned(), "K".to_owned());
            common.insert(OWNER_NAME.to_owned(), "inst".to_owned());
            assert_eq!(child_labels("K", "inst", "cache", mine), common);
        }
        assert_eq!(content_hash(b"abc"), content_hash(b"abc"));
        assert_ne!(content_hash(b"abc"), content_hash(b"abd"));
    }
}
