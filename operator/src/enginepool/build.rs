//! Pure construction of an engine pool's children: one Deployment of engine instances and one
//! Service in front of them. The engine learns how to reach the pool from environment variables
//! and the mounted pool config (docs/engine-contract.md). I/O boundary: none.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource, HTTPGetAction,
    ObjectFieldSelector, PodSpec, PodTemplateSpec, Probe, ResourceRequirements, Service,
    ServicePort, ServiceSpec, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kvpool::crd::EngineKind;

use super::validate::ValidEnginePool;
use crate::cachepool::build::{auth_volume, config_volume, socket_volume};
use crate::contract::{self, EngineLaunch, env};
use crate::labels;

/// Children of an engine pool.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineChildren {
    pub deployment: Deployment,
    pub service: Service,
}

/// Name of the engine Deployment and Service.
pub fn child_name(p: &ValidEnginePool) -> String {
    labels::child_name(&p.name, p.component)
}

fn meta(p: &ValidEnginePool) -> ObjectMeta {
    labels::child_meta(
        child_name(p),
        &p.namespace,
        labels::child_labels(p.kind, &p.name, &p.pool.name, p.component),
        &p.owner,
    )
}

/// The label selector of the engine pods, as a string (for the scale subresource).
pub fn selector_string(p: &ValidEnginePool) -> String {
    labels::selector_labels(&p.pool.name, &p.name, p.component)
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// `command` and `args` of the engine container.
pub fn command_args(p: &ValidEnginePool) -> (Option<Vec<String>>, Option<Vec<String>>) {
    let engine = &p.effective;
    let launch = EngineLaunch {
        role: engine.role,
        model: engine.model.as_deref().unwrap_or_default(),
        tensor_parallel_size: engine.tensor_parallel_size,
        user_args: &engine.args,
    };
    let (default_command, args) = match engine.kind {
        EngineKind::Custom => {
            let non_empty = |v: &Vec<String>| (!v.is_empty()).then(|| v.clone());
            return (non_empty(&engine.command), non_empty(&engine.args));
        }
        EngineKind::Vllm => contract::vllm_command_args(&launch),
        EngineKind::Sglang => contract::sglang_command_args(&launch),
    };
    let command = if engine.command.is_empty() {
        default_command
    } else {
        engine.command.clone()
    };
    (Some(command), Some(args))
}

fn plain_env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: Some(value.into()),
        ..EnvVar::default()
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

/// The contract's environment, then the user's; a user variable of the same name replaces
/// the operator's (no duplicates: server-side apply treats `env` as a map keyed by name).
pub fn engine_env(p: &ValidEnginePool) -> Vec<EnvVar> {
    let mut vars = vec![
        plain_env(env::MASTER_ADDR, p.pool.master_addr()),
        plain_env(env::AGENT_SOCKET, contract::agent_socket_path()),
        plain_env(env::ROLE, p.effective.role.as_str()),
        plain_env(
            env::BLOCK_SIZE_TOKENS,
            p.pool.effective.block_size_tokens.to_string(),
        ),
        plain_env(env::AUTH_KEY_FILE, contract::auth_key_path()),
        plain_env(env::CONFIG_FILE, contract::engine_config_path()),
        plain_env(env::POOL, p.pool.name.clone()),
        plain_env(env::ENGINE_POOL, p.name.clone()),
        field_env(env::NODE_NAME, "spec.nodeName"),
        field_env(env::POD_IP, "status.podIP"),
    ];
    if p.effective.kind == EngineKind::Vllm {
        vars.push(plain_env(
            env::MOONCAKE_CONFIG_PATH,
            contract::engine_config_path(),
        ));
    }
    for user in &p.effective.env {
        match vars.iter_mut().find(|v| v.name == user.name) {
            Some(existing) => *existing = user.clone(),
            None => vars.push(user.clone()),
        }
    }
    vars
}

/// Container resources: the user's, plus GPUs and RDMA resources (requests equal limits, as
/// extended resources require).
pub fn engine_resources(p: &ValidEnginePool) -> Option<ResourceRequirements> {
    let r = &p.effective;
    let mut res = r.container.clone().unwrap_or_default();
    let mut extended: BTreeMap<String, Quantity> = r.rdma.clone();
    if r.gpus > 0 {
        extended.insert(r.gpu_resource_name.clone(), Quantity(r.gpus.to_string()));
    }
    if !extended.is_empty() {
        let requests = res.requests.get_or_insert_with(BTreeMap::new);
        let limits = res.limits.get_or_insert_with(BTreeMap::new);
        for (k, v) in extended {
            requests.insert(k.clone(), v.clone());
            limits.insert(k, v);
        }
    }
    (res != ResourceRequirements::default()).then_some(res)
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.to_owned(),
        mount_path: path.to_owned(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    }
}

/// The engine Deployment and Service. `config_hash` is the hash of the pool's ConfigMap data,
/// so engines restart when the pool's config changes.
pub fn build(p: &ValidEnginePool, config_hash: &str) -> EngineChildren {
    let selector = labels::selector_labels(&p.pool.name, &p.name, p.component);
    let (command, args) = command_args(p);
    let probe = (p.effective.kind != EngineKind::Custom).then(|| Probe {
        http_get: Some(HTTPGetAction {
            path: Some("/health".to_owned()),
            port: IntOrString::String("http".to_owned()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(10),
        failure_threshold: Some(3),
        ..Probe::default()
    });
    let container = Container {
        name: "engine".to_owned(),
        image: Some(p.effective.image.clone()),
        command,
        args,
        env: Some(engine_env(p)),
        ports: Some(vec![ContainerPort {
            name: Some("http".to_owned()),
            container_port: i32::from(contract::ENGINE_PORT),
            protocol: Some("TCP".to_owned()),
            ..ContainerPort::default()
        }]),
        resources: engine_resources(p),
        readiness_probe: probe,
        volume_mounts: Some(vec![
            mount("config", contract::CONFIG_DIR, true),
            mount("auth", contract::AUTH_DIR, true),
            mount("socket", contract::SOCKET_DIR, false),
            mount("shm", "/dev/shm", false),
        ]),
        ..Container::default()
    };
    let pool_spec = &p.pool.spec;
    let deployment = Deployment {
        metadata: meta(p),
        spec: Some(DeploymentSpec {
            replicas: Some(i32::try_from(p.effective.replicas).unwrap_or(i32::MAX)),
            selector: LabelSelector {
                match_labels: Some(selector.clone()),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels::child_labels(
                        p.kind,
                        &p.name,
                        &p.pool.name,
                        p.component,
                    )),
                    annotations: Some(BTreeMap::from([(
                        labels::CONFIG_HASH.to_owned(),
                        config_hash.to_owned(),
                    )])),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    // Kept on the pool's nodes: the same selector and tolerations as the agent
                    // DaemonSet, so every engine pod has an agent next to it.
                    node_selector: (!pool_spec.node_selector.is_empty())
                        .then(|| pool_spec.node_selector.clone()),
                    tolerations: (!pool_spec.tolerations.is_empty())
                        .then(|| pool_spec.tolerations.clone()),
                    automount_service_account_token: Some(false),
                    containers: vec![container],
                    volumes: Some(vec![
                        config_volume(&p.pool.name),
                        auth_volume(&p.pool.name),
                        socket_volume(),
                        Volume {
                            name: "shm".to_owned(),
                            empty_dir: Some(EmptyDirVolumeSource {
                                medium: Some("Memory".to_owned()),
                                ..EmptyDirVolumeSource::default()
                            }),
                            ..Volume::default()
                        },
                    ]),
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        }),
        status: None,
    };
    let service = Service {
        metadata: meta(p),
        spec: Some(ServiceSpec {
            selector: Some(selector),
            ports: Some(vec![ServicePort {
                name: Some("http".to_owned()),
                port: i32::from(contract::ENGINE_PORT),
                target_port: Some(IntOrString::String("http".to_owned())),
                protocol: Some("TCP".to_owned()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        status: None,
    };
    EngineChildren {
        deployment,
        service,
    }
}
