//! Pieces of the pod templates and Services that every child workload shares (the agent
//! DaemonSet, the master and conductor Deployments, the engine Deployments): named ports,
//! admin probes, downward-API and plain env vars, mounts, the pool's config, auth and socket
//! volumes, label selectors. Pure constructors of Kubernetes types. I/O boundary: none.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction,
    HostPathVolumeSource, KeyToPath, LocalObjectReference, ObjectFieldSelector, Probe,
    ResourceRequirements, SeccompProfile, SecretVolumeSource, SecurityContext, Service,
    ServicePort, ServiceSpec, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use kvpool_proto::auth::Role;

use crate::contract;
use crate::labels::{self, Component};

/// Group that may read the mounted auth key (the kvpool images' non-root user and group).
pub const KEY_READER_GROUP: i64 = kvpool_crd::POOL_CLIENT_GROUP as i64;

/// The container runtime's default seccomp profile (`RuntimeDefault`).
pub fn runtime_default_seccomp() -> Option<SeccompProfile> {
    Some(SeccompProfile {
        type_: "RuntimeDefault".to_owned(),
        ..SeccompProfile::default()
    })
}

/// Security context of a container that holds no privilege: not privileged, no escalation,
/// every capability dropped but `add`, the root filesystem read-only when `read_only_root`.
pub fn unprivileged(read_only_root: bool, add: &[&str]) -> SecurityContext {
    SecurityContext {
        privileged: Some(false),
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(read_only_root),
        capabilities: capabilities_only(add),
        ..SecurityContext::default()
    }
}

/// Every capability dropped, then `add` given back (none added when it is empty).
pub fn capabilities_only(add: &[&str]) -> Option<Capabilities> {
    Some(Capabilities {
        add: (!add.is_empty()).then(|| add.iter().map(|c| (*c).to_owned()).collect()),
        drop: Some(vec!["ALL".to_owned()]),
    })
}

/// A named TCP container port.
pub fn port(name: &str, port: u16) -> ContainerPort {
    ContainerPort {
        name: Some(name.to_owned()),
        container_port: i32::from(port),
        protocol: Some("TCP".to_owned()),
        ..ContainerPort::default()
    }
}

/// Container ports from `(name, port)` pairs.
pub fn ports(named: &[(&str, u16)]) -> Vec<ContainerPort> {
    named.iter().map(|(name, p)| port(name, *p)).collect()
}

/// An HTTP GET probe of `path` on the `admin` port, every 10 s.
pub fn http_probe(path: &str, initial_delay: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_owned()),
            port: IntOrString::String("admin".to_owned()),
            ..HTTPGetAction::default()
        }),
        initial_delay_seconds: Some(initial_delay),
        period_seconds: Some(10),
        ..Probe::default()
    }
}

/// An env var holding `value`.
pub fn plain_env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: Some(value.into()),
        ..EnvVar::default()
    }
}

/// An env var filled from the pod's field `path` (downward API).
pub fn field_env(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.to_owned(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

/// Mount of volume `name` at `path`.
pub fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.to_owned(),
        mount_path: path.to_owned(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    }
}

/// Volume with the pool's ConfigMap.
pub fn config_volume(pool_name: &str) -> Volume {
    Volume {
        name: "config".to_owned(),
        config_map: Some(ConfigMapVolumeSource {
            name: labels::child_name(pool_name, Component::Config),
            ..ConfigMapVolumeSource::default()
        }),
        ..Volume::default()
    }
}

/// Volume with the pool's auth Secret: owner and group may read it; pods that run as non-root set
/// `fsGroup` ([`KEY_READER_GROUP`]) so that their processes are in that group.
pub fn auth_volume(pool_name: &str, component: Component) -> Volume {
    Volume {
        name: "auth".to_owned(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(labels::child_name(pool_name, Component::Auth)),
            default_mode: Some(0o440),
            // Only the workload's own credential, at the one key path every process reads.
            items: Some(vec![KeyToPath {
                key: auth_item(component).to_owned(),
                path: contract::AUTH_KEY_KEY.to_owned(),
                mode: None,
            }]),
            ..SecretVolumeSource::default()
        }),
        ..Volume::default()
    }
}

/// The auth Secret's item a workload of `component` mounts as its key file: the pool key for
/// the master (it checks every role's credentials), its role's credential file for the others.
pub fn auth_item(component: Component) -> &'static str {
    match component {
        Component::Master => contract::AUTH_KEY_KEY,
        Component::Agent => Role::Agent.name(),
        Component::Conductor => Role::Conductor.name(),
        Component::Prefill | Component::Decode => Role::Engine.name(),
        // Not workloads; the least powerful item.
        Component::Config | Component::Auth => Role::Observer.name(),
    }
}

/// A hostPath volume of a directory, created on the node if absent.
pub fn host_dir_volume(name: &str, path: &str) -> Volume {
    Volume {
        name: name.to_owned(),
        host_path: Some(HostPathVolumeSource {
            path: path.to_owned(),
            type_: Some("DirectoryOrCreate".to_owned()),
        }),
        ..Volume::default()
    }
}

/// hostPath volume of the agent socket directory.
pub fn socket_volume() -> Volume {
    host_dir_volume("socket", contract::HOST_SOCKET_DIR)
}

/// Mounts of the config and auth volumes.
pub fn common_mounts() -> Vec<VolumeMount> {
    vec![
        mount("config", contract::CONFIG_DIR, true),
        mount("auth", contract::AUTH_DIR, true),
    ]
}

/// The image pull secrets of a pod: those of each list in order, each name once; `None` when
/// there are none (the field stays unset).
pub fn pull_secrets<'a>(
    lists: impl IntoIterator<Item = &'a [LocalObjectReference]>,
) -> Option<Vec<LocalObjectReference>> {
    let mut out: Vec<LocalObjectReference> = Vec::new();
    for secret in lists.into_iter().flatten() {
        if !out.iter().any(|s| s.name == secret.name) {
            out.push(secret.clone());
        }
    }
    (!out.is_empty()).then_some(out)
}

/// A label selector matching exactly `labels`.
pub fn label_selector(labels: BTreeMap<String, String>) -> LabelSelector {
    LabelSelector {
        match_labels: Some(labels),
        ..LabelSelector::default()
    }
}

/// A Service selecting the pods with `selector`, each `(name, port)` forwarded to the pods'
/// container port of the same name.
pub fn service(
    metadata: ObjectMeta,
    selector: BTreeMap<String, String>,
    ports: &[(&str, u16)],
) -> Service {
    Service {
        metadata,
        spec: Some(ServiceSpec {
            selector: Some(selector),
            ports: Some(
                ports
                    .iter()
                    .map(|(name, p)| ServicePort {
                        name: Some((*name).to_owned()),
                        port: i32::from(*p),
                        target_port: Some(IntOrString::String((*name).to_owned())),
                        protocol: Some("TCP".to_owned()),
                        ..ServicePort::default()
                    })
                    .collect(),
            ),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// Add each extended resource (GPUs, RDMA devices, hugepages, SR-IOV functions) to both the
/// requests and the limits of `res`: Kubernetes requires the two to be equal for them.
pub fn add_extended_resources(
    res: &mut ResourceRequirements,
    extended: BTreeMap<String, Quantity>,
) {
    if extended.is_empty() {
        return;
    }
    let requests = res.requests.get_or_insert_with(BTreeMap::new);
    let limits = res.limits.get_or_insert_with(BTreeMap::new);
    for (k, v) in extended {
        requests.insert(k.clone(), v.clone());
        limits.insert(k, v);
    }
}
