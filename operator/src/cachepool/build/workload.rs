//! The shape the master and conductor share: a `kvpool <role>` container with named ports,
//! admin probes and the config and auth mounts, run by a Deployment as the image's non-root
//! user on a read-only root filesystem (with a writable `/tmp`) and with the pool's image pull
//! secrets, behind a Service that forwards the same named ports. I/O boundary: none.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, EnvVar, PodSecurityContext, PodSpec, PodTemplateSpec,
    ResourceRequirements, SecurityContext, Service, Volume,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::{meta, pod_labels, selector};
use crate::cachepool::validate::ValidCachePool;
use crate::contract;
use crate::labels::{self, Component};
use crate::pod::{self, KEY_READER_GROUP, mount};

/// Pod security context of the master and conductor: the `kvpool` image's non-root user, and
/// `fsGroup` so the auth key is readable.
fn nonroot_pod_security() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(KEY_READER_GROUP),
        run_as_group: Some(KEY_READER_GROUP),
        fs_group: Some(KEY_READER_GROUP),
        seccomp_profile: pod::runtime_default_seccomp(),
        ..PodSecurityContext::default()
    }
}

/// Container security context of the master and conductor: nothing beyond what they need.
fn restricted_container_security() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        capabilities: pod::capabilities_only(&[]),
        ..SecurityContext::default()
    }
}

/// What differs between the master's and the conductor's container.
pub(super) struct KvpoolContainer<'a> {
    pub name: &'a str,
    pub image: &'a str,
    pub args: Vec<String>,
    pub env: Option<Vec<EnvVar>>,
    /// Named container ports (the Service forwards the same names).
    pub ports: &'a [(&'a str, u16)],
    pub resources: Option<ResourceRequirements>,
}

/// The `kvpool` container: its ports, the admin probes and the config and auth mounts.
pub(super) fn kvpool_container(c: KvpoolContainer<'_>) -> Container {
    Container {
        name: c.name.to_owned(),
        image: Some(c.image.to_owned()),
        command: Some(contract::kvpool_command()),
        args: Some(c.args),
        env: c.env,
        ports: Some(pod::ports(c.ports)),
        resources: c.resources,
        readiness_probe: Some(pod::http_probe("/readyz", 2)),
        liveness_probe: Some(pod::http_probe("/livez", 10)),
        volume_mounts: Some(pod::common_mounts()),
        ..Container::default()
    }
}

/// A Deployment of `replicas` pods running `container` as the non-root user, with the config
/// hash annotation that rolls them when the pool's config changes.
pub(super) fn deployment(
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
                    image_pull_secrets: pod::pull_secrets([pool
                        .spec
                        .image_pull_secrets
                        .as_slice()]),
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
                        pod::config_volume(&pool.name),
                        pod::auth_volume(&pool.name, component),
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

/// The Service in front of the pool's pods of `component`.
pub(super) fn service(
    pool: &ValidCachePool,
    component: Component,
    ports: &[(&str, u16)],
) -> Service {
    pod::service(
        meta(pool, component),
        labels::selector_labels(&pool.name, &pool.name, component),
        ports,
    )
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{LocalObjectReference, PodSpec};

    use crate::test_fixtures::{roce, valid};

    fn names(pod: Option<&PodSpec>) -> Vec<String> {
        pod.and_then(|p| p.image_pull_secrets.clone())
            .into_iter()
            .flatten()
            .map(|s| s.name)
            .collect()
    }

    /// The agents, the master and the conductor all pull with the pool's secrets.
    #[test]
    fn every_workload_of_the_pool_pulls_with_its_secrets() {
        let mut pool = roce();
        let plain = super::super::build(&valid(&pool), "00").expect("build");
        assert!(
            names(
                plain
                    .master
                    .spec
                    .as_ref()
                    .and_then(|s| s.template.spec.as_ref())
            )
            .is_empty()
        );
        pool.spec.image_pull_secrets = ["mirror", "ghcr"]
            .map(|name| LocalObjectReference { name: name.into() })
            .to_vec();
        let children = super::super::build(&valid(&pool), "00").expect("build");
        let (conductor, _) = children.conductor.as_ref().expect("conductor");
        for (what, pod) in [
            (
                "agent",
                children
                    .agent
                    .spec
                    .as_ref()
                    .and_then(|s| s.template.spec.as_ref()),
            ),
            (
                "master",
                children
                    .master
                    .spec
                    .as_ref()
                    .and_then(|s| s.template.spec.as_ref()),
            ),
            (
                "conductor",
                conductor
                    .spec
                    .as_ref()
                    .and_then(|s| s.template.spec.as_ref()),
            ),
        ] {
            assert_eq!(names(pod), ["mirror", "ghcr"], "{what}");
        }
    }
}
