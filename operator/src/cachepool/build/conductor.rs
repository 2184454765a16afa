//! The conductor Deployment (`kvpool conductor`: the OpenAI-compatible front door and
//! KVCache-centric scheduler, which discovers the pool's engine pods through the API server as
//! its own ServiceAccount) and its Service. I/O boundary: none.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, ImageVolumeSource, PersistentVolumeClaimVolumeSource, Service, Volume,
    VolumeMount,
};
use kvpool_crd::TokenizerSpec;

use super::workload::{self, KvpoolContainer};
use crate::cachepool::validate::ValidCachePool;
use crate::contract;
use crate::labels::{self, Component};

/// Named ports of the conductor container and Service.
const CONDUCTOR_PORTS: [(&str, u16); 2] = [
    ("http", contract::CONDUCTOR_PORT),
    ("admin", contract::ADMIN_PORT),
];

/// The conductor Deployment and Service.
pub fn conductor(pool: &ValidCachePool, config_hash: &str) -> (Deployment, Service) {
    let c = &pool.spec.conductor;
    let slo = pool.effective.conductor.as_ref();
    let container = workload::kvpool_container(KvpoolContainer {
        name: "conductor",
        image: &pool.conductor_image,
        args: contract::conductor_args(
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
            &contract::ConductorModel {
                engine_block_size: c.engine_block_size.unsigned_abs().max(1),
                tokenizer_dir: c.tokenizer.as_ref().map(tokenizer_dir),
            },
        ),
        env: None,
        ports: &CONDUCTOR_PORTS,
        resources: c.resources.clone(),
    });
    let mut deployment = workload::deployment(
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
        if let Some(t) = &c.tokenizer {
            spec.volumes
                .get_or_insert_with(Vec::new)
                .push(tokenizer_volume(t));
            if let Some(container) = spec.containers.first_mut() {
                container
                    .volume_mounts
                    .get_or_insert_with(Vec::new)
                    .push(VolumeMount {
                        name: TOKENIZER_VOLUME.to_owned(),
                        mount_path: contract::TOKENIZER_MOUNT.to_owned(),
                        read_only: Some(true),
                        ..VolumeMount::default()
                    });
            }
        }
    }
    (
        deployment,
        workload::service(pool, Component::Conductor, &CONDUCTOR_PORTS),
    )
}

/// Name of the conductor's tokenizer volume.
const TOKENIZER_VOLUME: &str = "tokenizer";

/// The directory the conductor reads the tokenizer files from: the mount, or below it.
fn tokenizer_dir(t: &TokenizerSpec) -> String {
    match &t.sub_path {
        Some(sub) => format!("{}/{sub}", contract::TOKENIZER_MOUNT),
        None => contract::TOKENIZER_MOUNT.to_owned(),
    }
}

/// The volume of the tokenizer files, from the one source the spec names (validated).
fn tokenizer_volume(t: &TokenizerSpec) -> Volume {
    let mut v = Volume {
        name: TOKENIZER_VOLUME.to_owned(),
        ..Volume::default()
    };
    if let Some(name) = &t.config_map {
        v.config_map = Some(ConfigMapVolumeSource {
            name: name.clone(),
            ..ConfigMapVolumeSource::default()
        });
    } else if let Some(claim) = &t.persistent_volume_claim {
        v.persistent_volume_claim = Some(PersistentVolumeClaimVolumeSource {
            claim_name: claim.clone(),
            read_only: Some(true),
        });
    } else if let Some(image) = &t.image {
        v.image = Some(ImageVolumeSource {
            reference: Some(image.clone()),
            pull_policy: Some("IfNotPresent".to_owned()),
        });
    }
    v
}
