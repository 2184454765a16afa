//! Pure construction of a `KVCachePool`'s children from a [`ValidCachePool`]: the effective
//! config (ConfigMap), the auth Secret, the agent DaemonSet, the master Deployment and Service,
//! and, when enabled, the conductor Deployment and Service with the ServiceAccount, Role and
//! RoleBinding that let it list and watch the engine pods it discovers. No client, no clock, no randomness:
//! the auth key is passed in. I/O boundary: none.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::{DaemonSet, DaemonSetSpec, Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource,
    EnvVar, EnvVarSource, HTTPGetAction, HostPathVolumeSource, ObjectFieldSelector,
    PodSecurityContext, PodSpec, PodTemplateSpec, Probe, ResourceRequirements, SeccompProfile,
    Secret, SecretVolumeSource, SecurityContext, Service, ServiceAccount, ServicePort, ServiceSpec,
    Volume, VolumeMount,
};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kvpool_crd::{DramCapacity, Hugepages, Protocol, ValidatedKVCachePool};
use serde::Serialize;

use super::validate::ValidCachePool;
use crate::contract;
use crate::error::{Error, Result};
use crate::labels::{self, Component};

/// Kind label value of children owned by a KVCachePool.
pub const OWNER_KIND: &str = "KVCachePool";

/// Everything a KVCachePool owns.
#[derive(Clone, Debug, PartialEq)]
pub struct CachePoolChildren {
    pub config: ConfigMap,
    pub auth: Secret,
    pub agent: DaemonSet,
    pub master: Deployment,
    pub master_service: Service,
    /// Absent when the conductor is disabled.
    pub conductor: Option<(Deployment, Service)>,
    /// The conductor's identity and its right to discover engine pods; absent when disabled.
    pub conductor_rbac: Option<ConductorRbac>,
}

/// ServiceAccount, Role and RoleBinding of the conductor (all named `<pool>-conductor`).
#[derive(Clone, Debug, PartialEq)]
pub struct ConductorRbac {
    pub service_account: ServiceAccount,
    pub role: Role,
    pub role_binding: RoleBinding,
}

/// What the conductor's Role grants: listing and watching the Pods of its namespace (engine
/// discovery). The operator must hold these itself (`crate::rbac`), since RBAC forbids granting
/// more than one has.
pub const CONDUCTOR_POD_VERBS: [&str; 2] = ["list", "watch"];

/// The conductor's ServiceAccount, Role and RoleBinding.
pub fn conductor_rbac(pool: &ValidCachePool) -> ConductorRbac {
    let name = labels::child_name(&pool.name, Component::Conductor);
    ConductorRbac {
        service_account: ServiceAccount {
            metadata: meta(pool, Component::Conductor),
            automount_service_account_token: Some(false),
            ..ServiceAccount::default()
        },
        role: Role {
            metadata: meta(pool, Component::Conductor),
            rules: Some(vec![PolicyRule {
                api_groups: Some(vec![String::new()]),
                resources: Some(vec!["pods".to_owned()]),
                verbs: CONDUCTOR_POD_VERBS
                    .iter()
                    .map(|v| (*v).to_owned())
                    .collect(),
                ..PolicyRule::default()
            }]),
        },
        role_binding: RoleBinding {
            metadata: meta(pool, Component::Conductor),
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".to_owned(),
                kind: "Role".to_owned(),
                name: name.clone(),
            },
            subjects: Some(vec![Subject {
                kind: "ServiceAccount".to_owned(),
                name,
                namespace: Some(pool.namespace.clone()),
                ..Subject::default()
            }]),
        },
    }
}

/// The document written to `config.yaml`, read by the agent, master and conductor: the pool's
/// identity and addresses, followed by the effective settings (`kvpool_crd::ValidatedKVCachePool`,
/// flattened, so a reader that only knows that type can read the file as it is).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolConfig<'a> {
    pub pool: &'a str,
    pub namespace: &'a str,
    pub master_addr: String,
    pub auth_key_file: String,
    pub agent_socket: String,
    #[serde(flatten)]
    pub effective: &'a ValidatedKVCachePool,
}

/// The pool's config document.
pub fn pool_config(pool: &ValidCachePool) -> PoolConfig<'_> {
    PoolConfig {
        pool: &pool.name,
        namespace: &pool.namespace,
        master_addr: pool.master_addr(),
        auth_key_file: contract::auth_key_path(),
        agent_socket: contract::agent_socket_path(),
        effective: &pool.effective,
    }
}

fn protocol_str(p: Protocol) -> &'static str {
    match p {
        Protocol::Auto => "auto",
        Protocol::Rdma => "rdma",
        Protocol::Tcp => "tcp",
    }
}

/// The engine-facing JSON config (`engine.json`): what a KV connector inside vLLM or SGLang
/// needs to reach the pool. Keys follow the Mooncake store connector's config file where they
/// overlap, so that connector can read it as it is.
pub fn engine_config(pool: &ValidCachePool) -> serde_json::Value {
    let transport = &pool.effective.transport;
    serde_json::json!({
        "pool": pool.name,
        "master_server_address": pool.master_addr(),
        "metadata_server": "P2PHANDSHAKE",
        "protocol": match transport.protocol {
            Protocol::Tcp => "tcp",
            Protocol::Rdma | Protocol::Auto => "rdma",
        },
        "kvpool_protocol": protocol_str(transport.protocol),
        "device_name": transport.devices.join(","),
        "agent_socket": contract::agent_socket_path(),
        "block_size_tokens": pool.effective.block_size_tokens,
        "auth_key_file": contract::auth_key_path(),
    })
}

/// Render the ConfigMap data: `config.yaml` and `engine.json`.
pub fn config_data(pool: &ValidCachePool) -> Result<BTreeMap<String, String>> {
    let yaml = serde_saphyr::to_string(&pool_config(pool)).map_err(Error::RenderConfig)?;
    let json =
        serde_json::to_string_pretty(&engine_config(pool)).map_err(|source| Error::Serialize {
            what: "engine config",
            source,
        })?;
    Ok(BTreeMap::from([
        (contract::CONFIG_FILE_KEY.to_owned(), yaml),
        (contract::ENGINE_CONFIG_KEY.to_owned(), json),
    ]))
}

/// Hash of the ConfigMap data, for the pod-template annotation that rolls pods on change.
pub fn config_hash(data: &BTreeMap<String, String>) -> String {
    let mut buf = Vec::new();
    for (k, v) in data {
        buf.extend_from_slice(k.as_bytes());
        buf.push(0);
        buf.extend_from_slice(v.as_bytes());
        buf.push(0);
    }
    labels::content_hash(&buf)
}

fn meta(pool: &ValidCachePool, component: Component) -> ObjectMeta {
    labels::child_meta(
        labels::child_name(&pool.name, component),
        &pool.namespace,
        labels::child_labels(OWNER_KIND, &pool.name, &pool.name, component),
        &pool.owner,
    )
}

fn port(name: &str, port: u16) -> ContainerPort {
    ContainerPort {
        name: Some(name.to_owned()),
        container_port: i32::from(port),
        protocol: Some("TCP".to_owned()),
        ..ContainerPort::default()
    }
}

fn http_probe(path: &str, initial_delay: i32) -> Probe {
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

fn field_env(name: &str, path: &str) -> EnvVar {
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

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
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
pub fn auth_volume(pool_name: &str) -> Volume {
    Volume {
        name: "auth".to_owned(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(labels::child_name(pool_name, Component::Auth)),
            default_mode: Some(0o440),
            ..SecretVolumeSource::default()
        }),
        ..Volume::default()
    }
}

/// hostPath volume of the agent socket directory.
pub fn socket_volume() -> Volume {
    Volume {
        name: "socket".to_owned(),
        host_path: Some(HostPathVolumeSource {
            path: contract::HOST_SOCKET_DIR.to_owned(),
            type_: Some("DirectoryOrCreate".to_owned()),
        }),
        ..Volume::default()
    }
}

/// Mounts of the config, auth and socket volumes.
pub fn common_mounts() -> Vec<VolumeMount> {
    vec![
        mount("config", contract::CONFIG_DIR, true),
        mount("auth", contract::AUTH_DIR, true),
    ]
}

fn selector(pool: &ValidCachePool, component: Component) -> LabelSelector {
    LabelSelector {
        match_labels: Some(labels::selector_labels(&pool.name, &pool.name, component)),
        ..LabelSelector::default()
    }
}

fn pod_labels(pool: &ValidCachePool, component: Component) -> BTreeMap<String, String> {
    labels::child_labels(OWNER_KIND, &pool.name, &pool.name, component)
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
    if !extra.is_empty() {
        let requests = res.requests.get_or_insert_with(BTreeMap::new);
        let limits = res.limits.get_or_insert_with(BTreeMap::new);
        for (k, v) in extra {
            requests.insert(k.clone(), v.clone());
            limits.insert(k, v);
        }
        // Hugepage requests need a cpu or memory request next to them.
        if hugepages.is_some() && !requests.contains_key("memory") {
            requests.insert("memory".to_owned(), Quantity("256Mi".to_owned()));
        }
    }
    (res != ResourceRequirements::default()).then_some(res)
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
    let mut volumes = vec![
        config_volume(&pool.name),
        auth_volume(&pool.name),
        socket_volume(),
    ];
    let mut mounts = common_mounts();
    mounts.push(mount("socket", contract::SOCKET_DIR, false));
    if let Some(ssd) = &pool.effective.ssd {
        volumes.push(Volume {
            name: "ssd".to_owned(),
            host_path: Some(HostPathVolumeSource {
                path: ssd.host_path.clone(),
                type_: Some("DirectoryOrCreate".to_owned()),
            }),
            ..Volume::default()
        });
        // Same path inside the container as on the node, so the config's hostPath is valid in
        // both places.
        mounts.push(mount("ssd", &ssd.host_path, false));
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
            field_env(contract::env::NODE_NAME, "spec.nodeName"),
            field_env(contract::env::POD_IP, "status.podIP"),
        ]),
        ports: Some(vec![
            port("admin", contract::ADMIN_PORT),
            port("transfer", pool.effective.transport.port),
        ]),
        resources: agent_resources(pool),
        security_context: Some(SecurityContext {
            capabilities: Some(Capabilities {
                add: Some(vec!["IPC_LOCK".to_owned()]),
                ..Capabilities::default()
            }),
            ..SecurityContext::default()
        }),
        readiness_probe: Some(http_probe("/readyz", 2)),
        liveness_probe: Some(http_probe("/livez", 10)),
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
                    automount_service_account_token: Some(false),
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

/// Group that may read the mounted auth key (the kvpool images' non-root user and group).
pub const KEY_READER_GROUP: i64 = kvpool_crd::POOL_CLIENT_GROUP as i64;

/// Pod security context of the master and conductor: the `kvpool` image's non-root user, and
/// `fsGroup` so the auth key is readable.
fn nonroot_pod_security() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(KEY_READER_GROUP),
        run_as_group: Some(KEY_READER_GROUP),
        fs_group: Some(KEY_READER_GROUP),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".to_owned(),
            ..SeccompProfile::default()
        }),
        ..PodSecurityContext::default()
    }
}

/// Container security context of the master and conductor: nothing beyond what they need.
fn restricted_container_security() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_owned()]),
            ..Capabilities::default()
        }),
        ..SecurityContext::default()
    }
}

fn deployment(
    pool: &ValidCachePool,
    component: Component,
    replicas: i32,
    container: Container,
    config_hash: &str,
) -> Deployment {
    Deployment {
        metadata: meta(pool, component),
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: selector(pool, component),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels(pool, component)),
                    annotations: Some(BTreeMap::from([(
                        labels::CONFIG_HASH.to_owned(),
                        config_hash.to_owned(),
                    )])),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    automount_service_account_token: Some(false),
                    security_context: Some(nonroot_pod_security()),
                    containers: vec![Container {
                        security_context: Some(restricted_container_security()),
                        volume_mounts: Some(
                            container
                                .volume_mounts
                                .clone()
                                .unwrap_or_default()
                                .into_iter()
                                .chain([mount("tmp", "/tmp", false)])
                                .collect(),
                        ),
                        ..container
                    }],
                    // The root filesystem is read-only; /tmp is the one writable place.
                    volumes: Some(vec![
                        config_volume(&pool.name),
                        auth_volume(&pool.name),
                        Volume {
                            name: "tmp".to_owned(),
                            empty_dir: Some(EmptyDirVolumeSource::default()),
                            ..Volume::default()
                        },
                    ]),
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        }),
        status: None,
    }
}

fn service(pool: &ValidCachePool, component: Component, ports: &[(&str, u16)]) -> Service {
    Service {
        metadata: meta(pool, component),
        spec: Some(ServiceSpec {
            selector: Some(labels::selector_labels(&pool.name, &pool.name, component)),
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

/// The master Deployment.
pub fn master_deployment(pool: &ValidCachePool, config_hash: &str) -> Deployment {
    let master = &pool.spec.master;
    let container = Container {
        name: "master".to_owned(),
        image: Some(pool.master_image.clone()),
        command: Some(contract::kvpool_command()),
        args: Some(contract::master_args(&master.etcd_endpoints)),
        env: Some(vec![field_env(contract::env::POD_IP, "status.podIP")]),
        ports: Some(vec![
            port("grpc", contract::MASTER_PORT),
            port("admin", contract::ADMIN_PORT),
        ]),
        resources: master.resources.clone(),
        readiness_probe: Some(http_probe("/readyz", 2)),
        liveness_probe: Some(http_probe("/livez", 10)),
        volume_mounts: Some(common_mounts()),
        ..Container::default()
    };
    deployment(
        pool,
        Component::Master,
        master.replicas,
        container,
        config_hash,
    )
}

/// The master Service.
pub fn master_service(pool: &ValidCachePool) -> Service {
    service(
        pool,
        Component::Master,
        &[
            ("grpc", contract::MASTER_PORT),
            ("admin", contract::ADMIN_PORT),
        ],
    )
}

/// The conductor Deployment and Service.
pub fn conductor(pool: &ValidCachePool, config_hash: &str) -> (Deployment, Service) {
    let c = &pool.spec.conductor;
    let slo = pool.effective.conductor.as_ref();
    let container = Container {
        name: "conductor".to_owned(),
        image: Some(pool.conductor_image.clone()),
        command: Some(contract::kvpool_command()),
        args: Some(contract::conductor_args(
            &pool.name,
            &pool.namespace,
            &pool.master_addr(),
            slo.map_or(
                u64::from(kvpool_crd::defaults::TTFT_MILLIS.unsigned_abs()),
                |s| u64::from(s.ttft_millis),
            ),
            slo.map_or(
                u64::from(kvpool_crd::defaults::TPOT_MILLIS.unsigned_abs()),
                |s| u64::from(s.tpot_millis),
            ),
        )),
        ports: Some(vec![
            port("http", contract::CONDUCTOR_PORT),
            port("admin", contract::ADMIN_PORT),
        ]),
        resources: c.resources.clone(),
        readiness_probe: Some(http_probe("/readyz", 2)),
        liveness_probe: Some(http_probe("/livez", 10)),
        volume_mounts: Some(common_mounts()),
        ..Container::default()
    };
    let mut deployment = deployment(
        pool,
        Component::Conductor,
        c.replicas,
        container,
        config_hash,
    );
    // The conductor talks to the API server (engine discovery) as its own ServiceAccount; the
    // token is mounted into this pod only, not into every pod of the account.
    if let Some(spec) = deployment
        .spec
        .as_mut()
        .and_then(|s| s.template.spec.as_mut())
    {
        spec.service_account_name = Some(labels::child_name(&pool.name, Component::Conductor));
        spec.automount_service_account_token = Some(true);
    }
    (
        deployment,
        service(
            pool,
            Component::Conductor,
            &[
                ("http", contract::CONDUCTOR_PORT),
                ("admin", contract::ADMIN_PORT),
            ],
        ),
    )
}

/// The auth Secret holding `key` (hex). Created once; see `apply::create_if_absent`.
pub fn auth_secret(pool: &ValidCachePool, key_hex: &str) -> Secret {
    Secret {
        metadata: meta(pool, Component::Auth),
        type_: Some("Opaque".to_owned()),
        data: Some(BTreeMap::from([(
            contract::AUTH_KEY_KEY.to_owned(),
            ByteString(key_hex.as_bytes().to_vec()),
        )])),
        ..Secret::default()
    }
}

/// Every child of `pool`. `key_hex` is the auth key used only if the Secret does not exist yet.
pub fn build(pool: &ValidCachePool, key_hex: &str) -> Result<CachePoolChildren> {
    let data = config_data(pool)?;
    let hash = config_hash(&data);
    let config = ConfigMap {
        metadata: meta(pool, Component::Config),
        data: Some(data),
        ..ConfigMap::default()
    };
    Ok(CachePoolChildren {
        config,
        auth: auth_secret(pool, key_hex),
        agent: agent_daemonset(pool, &hash),
        master: master_deployment(pool, &hash),
        master_service: master_service(pool),
        conductor: pool
            .effective
            .conductor
            .is_some()
            .then(|| conductor(pool, &hash)),
        conductor_rbac: pool
            .effective
            .conductor
            .is_some()
            .then(|| conductor_rbac(pool)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::{roce, tcp, valid};
    use k8s_openapi::api::core::v1::Toleration;

    fn pod(ds: &DaemonSet) -> &PodSpec {
        ds.spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .expect("pod spec")
    }

    fn q(s: &str) -> Quantity {
        Quantity(s.to_owned())
    }

    #[test]
    fn roce_agent_daemonset_carries_every_node_level_setting() {
        let pool = valid(&roce());
        let children = build(&pool, "00ff").expect("build");
        let ds = &children.agent;
        assert_eq!(ds.metadata.name.as_deref(), Some("roce-agent"));
        assert_eq!(ds.metadata.namespace.as_deref(), Some("llm"));
        let owner = &ds.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!(owner.kind, "KVCachePool");
        assert_eq!(owner.name, "roce");
        assert_eq!(owner.uid, "6f1d2c3b-0000-4000-8000-000000000001");
        assert_eq!(owner.controller, Some(true));
        let labels = ds.metadata.labels.as_ref().expect("labels");
        assert_eq!(labels["app.kubernetes.io/managed-by"], "kvpool-operator");
        assert_eq!(labels["kvpool.dev/owner-kind"], "KVCachePool");
        assert_eq!(labels["kvpool.dev/component"], "agent");

        let spec = ds.spec.as_ref().expect("spec");
        let selector = spec.selector.match_labels.as_ref().expect("selector");
        let template_labels = spec
            .template
            .metadata
            .as_ref()
            .and_then(|m| m.labels.as_ref())
            .expect("template labels");
        for (k, v) in selector {
            assert_eq!(template_labels.get(k), Some(v), "selector label {k}");
        }
        let annotations = spec
            .template
            .metadata
            .as_ref()
            .and_then(|m| m.annotations.as_ref())
            .expect("annotations");
        assert_eq!(
            annotations[labels::MULTUS_NETWORKS],
            "llm/roce-a,llm/roce-b"
        );
        assert_eq!(annotations[labels::CONFIG_HASH].len(), 16);

        let pod = pod(ds);
        assert_eq!(
            pod.node_selector.as_ref().expect("node selector")["nvidia.com/gpu.product"],
            "H100-SXM"
        );
        assert_eq!(
            pod.tolerations.as_deref(),
            Some(
                &[Toleration {
                    key: Some("nvidia.com/gpu".into()),
                    operator: Some("Exists".into()),
                    effect: Some("NoSchedule".into()),
                    ..Toleration::default()
                }][..]
            )
        );
        assert_eq!(
            pod.priority_class_name.as_deref(),
            Some("system-node-critical")
        );

        let c = &pod.containers[0];
        assert_eq!(c.image.as_deref(), Some("ghcr.io/kvpool/kvpool-agent:test"));
        assert_eq!(c.command.as_deref(), Some(&["kvpool".to_owned()][..]));
        assert_eq!(
            c.args.as_deref().expect("args"),
            [
                "agent",
                "run",
                "--pool-config",
                "/etc/kvpool/config.yaml",
                "--admin-listen",
                "0.0.0.0:9090",
                "--socket-dir",
                "/run/kvpool",
                "--node-name",
                "$(KVPOOL_NODE_NAME)",
                "--advertise-host",
                "$(KVPOOL_POD_IP)"
            ]
        );
        let caps = c
            .security_context
            .as_ref()
            .and_then(|s| s.capabilities.as_ref())
            .and_then(|c| c.add.as_ref())
            .expect("capabilities");
        assert_eq!(caps, &["IPC_LOCK".to_owned()]);
        let res = c.resources.as_ref().expect("resources");
        let requests = res.requests.as_ref().expect("requests");
        let limits = res.limits.as_ref().expect("limits");
        assert_eq!(requests["hugepages-1Gi"], q("512Gi"));
        assert_eq!(limits["hugepages-1Gi"], q("512Gi"));
        assert_eq!(requests["nvidia.com/rdma_vf"], q("2"));
        assert_eq!(limits["nvidia.com/rdma_vf"], q("2"));
        assert_eq!(requests["cpu"], q("4"));
        assert_eq!(requests["memory"], q("8Gi"), "user's memory request kept");
        let ports: Vec<(Option<&str>, i32)> = c
            .ports
            .as_ref()
            .expect("ports")
            .iter()
            .map(|p| (p.name.as_deref(), p.container_port))
            .collect();
        assert_eq!(ports, [(Some("admin"), 9090), (Some("transfer"), 15500)]);

        let volumes = pod.volumes.as_ref().expect("volumes");
        let find = |name: &str| volumes.iter().find(|v| v.name == name).expect(name);
        assert_eq!(
            find("config").config_map.as_ref().map(|c| c.name.as_str()),
            Some("roce-config")
        );
        assert_eq!(
            find("auth")
                .secret
                .as_ref()
                .and_then(|s| s.secret_name.as_deref()),
            Some("roce-auth")
        );
        let socket = find("socket").host_path.as_ref().expect("socket hostPath");
        assert_eq!(socket.path, "/run/kvpool");
        assert_eq!(socket.type_.as_deref(), Some("DirectoryOrCreate"));
        let ssd = find("ssd").host_path.as_ref().expect("ssd hostPath");
        assert_eq!(ssd.path, "/mnt/nvme/kvpool");
        assert_eq!(
            find("hugepages")
                .empty_dir
                .as_ref()
                .and_then(|e| e.medium.as_deref()),
            Some("HugePages-1Gi")
        );
        let mounts: Vec<(&str, &str)> = c
            .volume_mounts
            .as_ref()
            .expect("mounts")
            .iter()
            .map(|m| (m.name.as_str(), m.mount_path.as_str()))
            .collect();
        assert!(mounts.contains(&("ssd", "/mnt/nvme/kvpool")));
        assert!(mounts.contains(&("socket", "/run/kvpool")));
        assert!(mounts.contains(&("auth", "/etc/kvpool/auth")));
        assert!(mounts.contains(&("hugepages", "/dev/hugepages")));
    }

    #[test]
    fn tcp_pool_has_no_rdma_hugepages_ssd_or_conductor() {
        let pool = valid(&tcp());
        let children = build(&pool, "00ff").expect("build");
        let ds = &children.agent;
        let pod = pod(ds);
        assert!(pod.node_selector.is_none());
        assert!(pod.tolerations.is_none());
        let annotations = ds
            .spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.annotations.as_ref())
            .expect("annotations");
        assert!(!annotations.contains_key(labels::MULTUS_NETWORKS));
        let c = &pod.containers[0];
        assert!(
            c.resources.is_none(),
            "no extended resources: {:?}",
            c.resources
        );
        let volumes: Vec<&str> = pod
            .volumes
            .as_ref()
            .expect("volumes")
            .iter()
            .map(|v| v.name.as_str())
            .collect();
        assert_eq!(volumes, ["config", "auth", "socket"]);
        assert!(children.conductor.is_none());
    }

    #[test]
    fn explicit_dram_in_ordinary_pages_is_requested_as_memory() {
        let mut pool = tcp();
        pool.spec.dram.node_memory_percent = None;
        pool.spec.dram.capacity_per_node = Some(q("64Gi"));
        let children = build(&valid(&pool), "00ff").expect("build");
        let c = &pod(&children.agent).containers[0];
        let res = c.resources.as_ref().expect("resources");
        assert_eq!(
            res.requests.as_ref().expect("requests")["memory"],
            q("64Gi")
        );
        assert!(res.limits.is_none(), "no limit imposed: {res:?}");

        // A user's own memory request wins.
        pool.spec.agent.resources = Some(ResourceRequirements {
            requests: Some(BTreeMap::from([("memory".to_owned(), q("80Gi"))])),
            ..ResourceRequirements::default()
        });
        let children = build(&valid(&pool), "00ff").expect("build");
        let c = &pod(&children.agent).containers[0];
        let requests = c
            .resources
            .as_ref()
            .and_then(|r| r.requests.as_ref())
            .expect("requests");
        assert_eq!(requests["memory"], q("80Gi"));
    }

    #[test]
    fn master_and_conductor_follow_the_contract() {
        let pool = valid(&roce());
        let children = build(&pool, "00ff").expect("build");
        let master = &children.master;
        assert_eq!(master.metadata.name.as_deref(), Some("roce-master"));
        let spec = master.spec.as_ref().expect("spec");
        assert_eq!(spec.replicas, Some(3));
        let c = &spec.template.spec.as_ref().expect("pod").containers[0];
        assert_eq!(c.command.as_deref(), Some(&["kvpool".to_owned()][..]));
        assert_eq!(
            c.args.as_deref().expect("args"),
            [
                "master",
                "--listen",
                "0.0.0.0:50051",
                "--admin-addr",
                "0.0.0.0:9090",
                "--auth-key-file",
                "/etc/kvpool/auth/key",
                "--etcd-endpoints",
                "http://etcd-0.etcd:2379,http://etcd-1.etcd:2379",
                "--advertise-addr",
                "$(KVPOOL_POD_IP):50051"
            ]
        );
        let env = c.env.as_deref().expect("env");
        assert!(
            env.iter().any(|e| e.name == "KVPOOL_POD_IP"
                && e.value_from
                    .as_ref()
                    .and_then(|v| v.field_ref.as_ref())
                    .is_some_and(|f| f.field_path == "status.podIP")),
            "the pod IP the advertise address expands: {env:?}"
        );
        let pod = spec.template.spec.as_ref().expect("pod");
        let psc = pod.security_context.as_ref().expect("pod security context");
        assert_eq!(psc.run_as_non_root, Some(true));
        assert_eq!(
            psc.fs_group,
            Some(KEY_READER_GROUP),
            "auth key readable by the group"
        );
        let csc = c
            .security_context
            .as_ref()
            .expect("container security context");
        assert_eq!(csc.allow_privilege_escalation, Some(false));
        assert_eq!(csc.read_only_root_filesystem, Some(true));
        let auth = pod
            .volumes
            .as_ref()
            .and_then(|v| v.iter().find(|v| v.name == "auth"))
            .and_then(|v| v.secret.as_ref())
            .expect("auth volume");
        assert_eq!(auth.default_mode, Some(0o440));
        assert!(
            c.volume_mounts
                .as_ref()
                .is_some_and(|m| m.iter().any(|m| m.name == "tmp" && m.mount_path == "/tmp")),
            "writable /tmp next to the read-only root filesystem"
        );
        let svc = children.master_service.spec.as_ref().expect("svc");
        let ports: Vec<(Option<&str>, i32)> = svc
            .ports
            .as_ref()
            .expect("ports")
            .iter()
            .map(|p| (p.name.as_deref(), p.port))
            .collect();
        assert_eq!(ports, [(Some("grpc"), 50051), (Some("admin"), 9090)]);
        assert_eq!(
            svc.selector.as_ref(),
            Some(&labels::selector_labels("roce", "roce", Component::Master))
        );

        let (conductor, conductor_svc) = children.conductor.as_ref().expect("conductor");
        assert_eq!(conductor.metadata.name.as_deref(), Some("roce-conductor"));
        let spec = conductor.spec.as_ref().expect("spec");
        assert_eq!(spec.replicas, Some(2));
        let c = &spec.template.spec.as_ref().expect("pod").containers[0];
        assert_eq!(
            c.args.as_deref().expect("args"),
            [
                "conductor",
                "--listen",
                "0.0.0.0:8000",
                "--admin-listen",
                "0.0.0.0:9090",
                "--ttft-slo-s",
                "1.5",
                "--tpot-slo-s",
                "0.04",
                "--discover-namespace",
                "llm",
                "--prefill-selector",
                "app.kubernetes.io/name=kvpool,kvpool.dev/pool=roce,kvpool.dev/component=prefill",
                "--decode-selector",
                "app.kubernetes.io/name=kvpool,kvpool.dev/pool=roce,kvpool.dev/component=decode",
                "--engine-port",
                "8000",
                "--master",
                "roce-master.llm.svc:50051",
                "--auth-key-file",
                "/etc/kvpool/auth/key"
            ]
        );
        assert_eq!(
            conductor_svc.metadata.name.as_deref(),
            Some("roce-conductor")
        );
    }

    #[test]
    fn config_map_holds_the_validated_pool_and_engine_config() {
        let pool = valid(&roce());
        let children = build(&pool, "00ff").expect("build");
        let data = children.config.data.as_ref().expect("data");
        let yaml = &data["config.yaml"];
        #[derive(serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Head {
            pool: String,
            master_addr: String,
            auth_key_file: String,
        }
        let head: Head = serde_saphyr::from_str(yaml).expect("config.yaml parses");
        assert_eq!(head.pool, "roce");
        assert_eq!(head.master_addr, "roce-master.llm.svc:50051");
        assert_eq!(head.auth_key_file, "/etc/kvpool/auth/key");
        // The data plane reads the rest as kvpool_crd::ValidatedKVCachePool.
        let effective: ValidatedKVCachePool =
            serde_saphyr::from_str(yaml).expect("config.yaml parses as ValidatedKVCachePool");
        assert_eq!(effective, pool.effective);
        assert_eq!(effective.block_size_tokens, 256);

        let engine: serde_json::Value =
            serde_json::from_str(&data["engine.json"]).expect("engine.json parses");
        assert_eq!(engine["master_server_address"], "roce-master.llm.svc:50051");
        assert_eq!(engine["protocol"], "rdma");
        assert_eq!(engine["device_name"], "mlx5_0,mlx5_1");
        assert_eq!(engine["agent_socket"], "/run/kvpool/agent.sock");

        // The hash follows the data: change a setting, the hash changes.
        let mut other = roce();
        other.spec.block_size_tokens = 512;
        let other = build(&valid(&other), "00ff").expect("build");
        let hash = |c: &CachePoolChildren| {
            c.agent
                .spec
                .as_ref()
                .and_then(|s| s.template.metadata.as_ref())
                .and_then(|m| m.annotations.as_ref())
                .map(|a| a[labels::CONFIG_HASH].clone())
        };
        assert_ne!(hash(&children), hash(&other));
    }

    #[test]
    fn auth_secret_carries_the_given_key_and_build_is_deterministic() {
        let pool = valid(&tcp());
        let a = build(&pool, "abcd").expect("build");
        let b = build(&pool, "abcd").expect("build");
        assert_eq!(a, b);
        let data = a.auth.data.as_ref().expect("data");
        assert_eq!(data["key"].0, b"abcd");
        assert_eq!(a.auth.metadata.name.as_deref(), Some("tcp-auth"));
    }

    #[test]
    fn conductor_discovers_engines_with_its_own_least_privilege_identity() {
        let pool = valid(&roce());
        let children = build(&pool, "00ff").expect("build");
        let (deployment, _) = children.conductor.as_ref().expect("conductor");
        let spec = deployment
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .expect("pod spec");
        assert_eq!(spec.service_account_name.as_deref(), Some("roce-conductor"));
        assert_eq!(spec.automount_service_account_token, Some(true));
        let args = spec.containers[0].args.as_ref().expect("args");
        let after = |flag: &str| {
            args.windows(2)
                .find(|w| w[0] == flag)
                .map(|w| w[1].as_str())
        };
        assert_eq!(after("--discover-namespace"), Some("llm"));
        assert_eq!(
            after("--decode-selector"),
            Some("app.kubernetes.io/name=kvpool,kvpool.dev/pool=roce,kvpool.dev/component=decode")
        );
        assert_eq!(after("--engine-port"), Some("8000"));

        let rbac = children.conductor_rbac.as_ref().expect("rbac");
        for meta in [
            &rbac.service_account.metadata,
            &rbac.role.metadata,
            &rbac.role_binding.metadata,
        ] {
            assert_eq!(meta.name.as_deref(), Some("roce-conductor"));
            assert_eq!(meta.namespace.as_deref(), Some("llm"));
            let owner = &meta.owner_references.as_ref().expect("owner")[0];
            assert_eq!(
                (owner.kind.as_str(), owner.controller),
                ("KVCachePool", Some(true))
            );
        }
        let rules = rbac.role.rules.as_ref().expect("rules");
        assert_eq!(rules.len(), 1);
        assert_eq!(rules[0].api_groups, Some(vec![String::new()]));
        assert_eq!(rules[0].resources, Some(vec!["pods".to_owned()]));
        assert_eq!(rules[0].verbs, vec!["list", "watch"]);
        assert_eq!(rbac.role_binding.role_ref.name, "roce-conductor");
        let subject = &rbac.role_binding.subjects.as_ref().expect("subjects")[0];
        assert_eq!(
            (
                subject.kind.as_str(),
                subject.name.as_str(),
                subject.namespace.as_deref()
            ),
            ("ServiceAccount", "roce-conductor", Some("llm"))
        );

        // Disabled conductor: none of it.
        let mut off = roce();
        off.spec.conductor.enabled = false;
        let children = build(&valid(&off), "00ff").expect("build");
        assert!(children.conductor.is_none() && children.conductor_rbac.is_none());
    }

    #[test]
    fn agent_requests_every_sriov_rail_resource() {
        let mut pool = roce();
        pool.spec.transport.sriov = Some(kvpool_crd::SriovSpec {
            resource_name: None,
            count: 1,
            resources: (0..8)
                .map(|i| kvpool_crd::SriovResource {
                    resource_name: format!("nvidia.com/roce_vf_rail{i}"),
                    count: 1,
                })
                .collect(),
        });
        let children = build(&valid(&pool), "00ff").expect("build");
        let res = pod(&children.agent).containers[0]
            .resources
            .as_ref()
            .expect("resources");
        for map in [&res.requests, &res.limits] {
            let map = map.as_ref().expect("set");
            for i in 0..8 {
                assert_eq!(
                    map.get(&format!("nvidia.com/roce_vf_rail{i}")),
                    Some(&q("1")),
                    "rail {i}"
                );
            }
            assert!(!map.contains_key("nvidia.com/roce_vf"));
        }
    }
}
