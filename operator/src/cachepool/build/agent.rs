//! The node agent DaemonSet: one `kvpool agent run` pod per selected node, with the node-level
//! settings of the pool (node selector, tolerations, Multus networks, hugepages, SR-IOV
//! functions, the SSD directory and the socket directory the engines share), run with the
//! smallest privileges the agent needs (root with every capability dropped but
//! [`AGENT_CAPABILITIES`], RuntimeDefault seccomp, read-only root filesystem; docs/images.md
//! says why each is needed). I/O boundary: none.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DaemonSet, DaemonSetSpec};
use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, PodSecurityContext, PodSpec, PodTemplateSpec,
    ProjectedVolumeSource, ResourceRequirements, SecurityContext, ServiceAccountTokenProjection,
    Volume, VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kvpool_crd::{DramCapacity, Hugepages};

use super::{meta, pod_labels, selector};
use crate::cachepool::validate::ValidCachePool;
use crate::contract;
use crate::labels::{self, Component};
use crate::pod::{self, KEY_READER_GROUP, mount};

/// The capabilities the agent keeps; every other one is dropped. `IPC_LOCK`: the DRAM tier is
/// locked in memory (`mlock`) and registered with the RDMA NIC, which pins its pages beyond
/// `RLIMIT_MEMLOCK`. `SYS_NICE`: the container runtimes' RuntimeDefault seccomp profile allows
/// `mbind` (the NUMA placement of every DRAM segment) only to a container holding it.
pub const AGENT_CAPABILITIES: [&str; 2] = ["IPC_LOCK", "SYS_NICE"];

/// Pod security context of the agent: the image's root user (it creates its socket and SSD
/// files in root-owned hostPath directories, and a non-root process cannot use added
/// capabilities), RuntimeDefault seccomp, and the engines' group as a supplementary group so
/// that it may hand its socket and staging files to that group without `CAP_CHOWN`.
fn agent_pod_security() -> PodSecurityContext {
    PodSecurityContext {
        supplemental_groups: Some(vec![KEY_READER_GROUP]),
        seccomp_profile: pod::runtime_default_seccomp(),
        ..PodSecurityContext::default()
    }
}

/// Container security context of the agent: no privilege escalation, a read-only root
/// filesystem (it writes only to its volumes), and only [`AGENT_CAPABILITIES`].
fn agent_container_security() -> SecurityContext {
    pod::unprivileged(true, &AGENT_CAPABILITIES)
}

fn hugepages_resource(h: Hugepages) -> Option<&'static str> {
    match h {
        Hugepages::None => None,
        Hugepages::Size2Mi => Some("hugepages-2Mi"),
        Hugepages::Size1Gi => Some("hugepages-1Gi"),
    }
}

/// Agent resources: the user's, plus hugepages (requests = limits, as Kubernetes requires) and
/// SR-IOV virtual functions. A DRAM tier of an explicit size in ordinary pages is requested as
/// memory (unless the user set a memory request), so the scheduler reserves what the agent pins
/// and the pod is not the first to be evicted under memory pressure.
fn agent_resources(pool: &ValidCachePool) -> Option<ResourceRequirements> {
    let spec = &pool.spec;
    let mut res = spec.agent.resources.clone().unwrap_or_default();
    let mut extra: BTreeMap<String, Quantity> = BTreeMap::new();
    let hugepages = hugepages_resource(pool.effective.dram.hugepages);
    if let (Some(name), DramCapacity::Bytes(bytes)) = (hugepages, pool.effective.dram.capacity) {
        extra.insert(name.to_owned(), kvpool_crd::quantity::format_bytes(bytes));
    }
    // One extended resource per rail (or one for all rails): each is requested on its own.
    for r in pool
        .effective
        .transport
        .sriov
        .iter()
        .flat_map(|s| s.resources.iter())
    {
        extra.insert(r.resource_name.clone(), Quantity(r.count.to_string()));
    }
    if let (None, DramCapacity::Bytes(bytes)) = (hugepages, pool.effective.dram.capacity) {
        let requests = res.requests.get_or_insert_with(BTreeMap::new);
        requests
            .entry("memory".to_owned())
            .or_insert_with(|| kvpool_crd::quantity::format_bytes(bytes));
    }
    let has_extra = !extra.is_empty();
    pod::add_extended_resources(&mut res, extra);
    // Hugepage requests need a cpu or memory request next to them.
    if has_extra && hugepages.is_some() {
        let requests = res.requests.get_or_insert_with(BTreeMap::new);
        if !requests.contains_key("memory") {
            requests.insert("memory".to_owned(), Quantity("256Mi".to_owned()));
        }
    }
    (res != ResourceRequirements::default()).then_some(res)
}

/// The agent's projected ServiceAccount token for the credential issuer: its own audience
/// (useless against the API server), bound to the pod, short-lived.
fn agent_token_volume() -> Volume {
    Volume {
        name: "agent-token".to_owned(),
        projected: Some(ProjectedVolumeSource {
            sources: Some(vec![VolumeProjection {
                service_account_token: Some(ServiceAccountTokenProjection {
                    audience: Some(kvpool_proto::issuer::AUDIENCE.to_owned()),
                    expiration_seconds: Some(contract::AGENT_TOKEN_SECONDS),
                    path: contract::AGENT_TOKEN_FILE.to_owned(),
                }),
                ..VolumeProjection::default()
            }]),
            ..ProjectedVolumeSource::default()
        }),
        ..Volume::default()
    }
}

/// The node agent DaemonSet.
pub fn agent_daemonset(pool: &ValidCachePool, config_hash: &str) -> DaemonSet {
    let spec = &pool.spec;
    let mut annotations =
        BTreeMap::from([(labels::CONFIG_HASH.to_owned(), config_hash.to_owned())]);
    if !pool.effective.transport.networks.is_empty() {
        annotations.insert(
            labels::MULTUS_NETWORKS.to_owned(),
            pool.effective.transport.networks.join(","),
        );
    }
    // With the issuer, each agent gets its own node's credential from the operator on proof
    // of its pod: no shared agent file in the pod at all.
    let (credential, credential_mount) = if pool.agent_issuer.is_some() {
        (
            agent_token_volume(),
            mount("agent-token", contract::AGENT_TOKEN_DIR, true),
        )
    } else {
        (
            pod::auth_volume(&pool.name, Component::Agent),
            mount("auth", contract::AUTH_DIR, true),
        )
    };
    let mut volumes = vec![
        pod::config_volume(&pool.name),
        credential,
        pod::socket_volume(),
    ];
    let mut mounts = vec![
        mount("config", contract::CONFIG_DIR, true),
        credential_mount,
        mount("socket", contract::SOCKET_DIR, false),
    ];
    // The root filesystem is read-only; /tmp is the one writable place besides the volumes.
    volumes.push(Volume {
        name: "tmp".to_owned(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    });
    mounts.push(mount("tmp", "/tmp", false));
    if let Some(ssd) = &pool.effective.ssd {
        volumes.push(pod::host_dir_volume("ssd", &ssd.host_path));
        // Same path inside the container as on the node, so the config's hostPath is valid in
        // both places.
        mounts.push(mount("ssd", &ssd.host_path, false));
    }
    if let Some(p) = &pool.effective.dram.persistence {
        // The DRAM tier's files (tmpfs or hugetlbfs on the node) outlive the pod: a restarted
        // or upgraded agent finds its blocks there. Same paths inside as on the node.
        volumes.push(pod::host_dir_volume("dram-tier", &p.host_path));
        mounts.push(mount("dram-tier", &p.host_path, false));
        if p.index_host_path != p.host_path {
            volumes.push(pod::host_dir_volume("dram-index", &p.index_host_path));
            mounts.push(mount("dram-index", &p.index_host_path, false));
        }
    }
    if let Some(size) = hugepages_resource(pool.effective.dram.hugepages) {
        let medium = size.trim_start_matches("hugepages-");
        volumes.push(Volume {
            name: "hugepages".to_owned(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some(format!("HugePages-{medium}")),
                ..EmptyDirVolumeSource::default()
            }),
            ..Volume::default()
        });
        mounts.push(mount("hugepages", "/dev/hugepages", false));
    }
    let container = Container {
        name: "agent".to_owned(),
        image: Some(pool.agent_image.clone()),
        command: Some(contract::agent_command()),
        args: Some(contract::agent_args()),
        env: Some(vec![
            pod::field_env(contract::env::NODE_NAME, "spec.nodeName"),
            pod::field_env(contract::env::POD_IP, "status.podIP"),
        ]),
        ports: Some(pod::ports(&[
            ("admin", contract::ADMIN_PORT),
            ("transfer", pool.effective.transport.port),
        ])),
        resources: agent_resources(pool),
        security_context: Some(agent_container_security()),
        readiness_probe: Some(pod::http_probe("/readyz", 2)),
        liveness_probe: Some(pod::http_probe("/livez", 10)),
        volume_mounts: Some(mounts),
        ..Container::default()
    };
    DaemonSet {
        metadata: meta(pool, Component::Agent),
        spec: Some(DaemonSetSpec {
            selector: selector(pool, Component::Agent),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels(pool, Component::Agent)),
                    annotations: Some(annotations),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    node_selector: (!spec.node_selector.is_empty())
                        .then(|| spec.node_selector.clone()),
                    tolerations: (!spec.tolerations.is_empty()).then(|| spec.tolerations.clone()),
                    priority_class_name: spec.agent.priority_class_name.clone(),
                    image_pull_secrets: pod::pull_secrets([spec.image_pull_secrets.as_slice()]),
                    // The agent reads and labels its Node object only as the ServiceAccount
                    // the pool names (bound to the agent ClusterRole); otherwise no token.
                    service_account_name: spec.agent.service_account_name.clone(),
                    automount_service_account_token: Some(
                        spec.agent.service_account_name.is_some(),
                    ),
                    security_context: Some(agent_pod_security()),
                    containers: vec![container],
                    volumes: Some(volumes),
                    ..PodSpec::default()
                }),
            },
            ..DaemonSetSpec::default()
        }),
        status: None,
    }
}
