//! The engine Deployment: `replicas` instances on the pool's nodes (the agent DaemonSet's node
//! selector and tolerations), in the group that may read the pool's key, with the pod
//! annotations the conductor routes by, the pool's image pull secrets and the init container
//! that puts the `kvpool` Python package into the pod. I/O boundary: none.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, PodSecurityContext, PodSpec, PodTemplateSpec, Volume,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kvpool_crd::EngineKind;

use super::{meta, python};
use crate::contract;
use crate::enginepool::validate::ValidEnginePool;
use crate::labels;
use crate::pod::{self, KEY_READER_GROUP};

/// Annotations of the engine pods: the config hash (a changed config rolls the pods) and, for
/// `vllm` and `sglang` engines, the routing convention the conductor follows for them
/// (`kvpool.dev/engine-protocol`, plus `kvpool.dev/bootstrap-port` for SGLang). Custom engines
/// declare none and are routed by the conductor's `--engine-protocol`.
pub fn pod_annotations(p: &ValidEnginePool, config_hash: &str) -> BTreeMap<String, String> {
    let mut notes = BTreeMap::from([(labels::CONFIG_HASH.to_owned(), config_hash.to_owned())]);
    let engine = &p.effective;
    match engine.kind {
        EngineKind::Custom => {}
        EngineKind::Vllm => {
            notes.insert(
                labels::ENGINE_PROTOCOL_ANNOTATION.to_owned(),
                "vllm".to_owned(),
            );
        }
        EngineKind::Sglang => {
            notes.insert(
                labels::ENGINE_PROTOCOL_ANNOTATION.to_owned(),
                "sglang".to_owned(),
            );
            notes.insert(
                labels::BOOTSTRAP_PORT_ANNOTATION.to_owned(),
                contract::sglang_bootstrap_port(&engine.args).to_string(),
            );
        }
    }
    notes
}

/// The engine Deployment running `container`; `config_hash` is the hash of the pool's ConfigMap
/// data, so engines restart when the pool's config changes.
pub fn engine_deployment(
    p: &ValidEnginePool,
    container: Container,
    config_hash: &str,
) -> Deployment {
    let selector = labels::selector_labels(&p.pool.name, &p.name, p.component);
    let pool_spec = &p.pool.spec;
    Deployment {
        metadata: meta(p),
        spec: Some(DeploymentSpec {
            replicas: Some(i32::try_from(p.effective.replicas).unwrap_or(i32::MAX)),
            selector: pod::label_selector(selector),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels::child_labels(
                        p.kind,
                        &p.name,
                        &p.pool.name,
                        p.component,
                    )),
                    annotations: Some(pod_annotations(p, config_hash)),
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
                    // The pool's pull secrets: the init container runs the `kvpool` image.
                    image_pull_secrets: pod::pull_secrets([p
                        .pool
                        .spec
                        .image_pull_secrets
                        .as_slice()]),
                    // Puts the engine's processes in the group that may read the auth key,
                    // whatever user the engine image runs as; the runtime's default seccomp
                    // profile for every container of the pod.
                    security_context: Some(PodSecurityContext {
                        fs_group: Some(KEY_READER_GROUP),
                        seccomp_profile: pod::runtime_default_seccomp(),
                        ..PodSecurityContext::default()
                    }),
                    init_containers: Some(vec![python::python_init_container(p)]),
                    containers: vec![container],
                    volumes: Some(vec![
                        pod::config_volume(&p.pool.name),
                        pod::auth_volume(&p.pool.name, p.component),
                        pod::socket_volume(),
                        Volume {
                            name: super::SHM_VOLUME.to_owned(),
                            empty_dir: Some(EmptyDirVolumeSource {
                                medium: Some("Memory".to_owned()),
                                ..EmptyDirVolumeSource::default()
                            }),
                            ..Volume::default()
                        },
                        python::python_volume(),
                    ]),
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        }),
        status: None,
    }
}
