//! The conductor Deployment (`kvpool conductor`: the OpenAI-compatible front door and
//! KVCache-centric scheduler, which discovers the pool's engine pods through the API server as
//! its own ServiceAccount) and its Service. The Secrets of its client and engine API keys, when
//! the pool names them, are mounted and passed as `--api-key-file` and `--engine-api-key-file`.
//! I/O boundary: none.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, ImageVolumeSource, KeyToPath, PersistentVolumeClaimVolumeSource,
    SecretVolumeSource, Service, Volume, VolumeMount,
};
use kvpool_crd::{ConductorSpec, SecretKeyRef, TokenizerSpec};

use super::workload::{self, KvpoolContainer};
use crate::cachepool::validate::ValidCachePool;
use crate::contract;
use crate::labels::{self, Component};
use crate::pod::mount;
use crate::serving::{ConductorFacts, ModelFiles};

/// Named ports of the conductor container and Service.
const CONDUCTOR_PORTS: [(&str, u16); 2] = [
    ("http", contract::CONDUCTOR_PORT),
    ("admin", contract::ADMIN_PORT),
];

/// The conductor Deployment and Service.
/// `facts` are what the engine pools say about the served model: their tensor parallel size,
/// and the claim holding the model, mounted read-only and passed as `--model-dir`.
pub fn conductor(
    pool: &ValidCachePool,
    config_hash: &str,
    facts: &ConductorFacts,
) -> (Deployment, Service) {
    let c = &pool.spec.conductor;
    let slo = pool.effective.conductor.as_ref();
    let mut args = contract::conductor_args(
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
            model_dir: facts.model_files.as_ref().map(model_dir),
            tensor_parallel_size: facts.tensor_parallel_size,
        },
    );
    let key_files = key_files(c);
    for k in &key_files {
        args.extend([format!("--{}", k.flag), k.file_path()]);
    }
    let container = workload::kvpool_container(KvpoolContainer {
        name: "conductor",
        image: &pool.conductor_image,
        args,
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
        for k in &key_files {
            spec.volumes.get_or_insert_with(Vec::new).push(k.volume());
            if let Some(container) = spec.containers.first_mut() {
                container
                    .volume_mounts
                    .get_or_insert_with(Vec::new)
                    .push(mount(k.volume, k.dir, true));
            }
        }
        if let Some(files) = &facts.model_files {
            spec.volumes.get_or_insert_with(Vec::new).push(Volume {
                name: MODEL_VOLUME.to_owned(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: files.claim.clone(),
                    read_only: Some(true),
                }),
                ..Volume::default()
            });
            if let Some(container) = spec.containers.first_mut() {
                container
                    .volume_mounts
                    .get_or_insert_with(Vec::new)
                    .push(mount(MODEL_VOLUME, contract::MODEL_MOUNT, true));
            }
        }
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

/// A key file the conductor reads at start, from a key of a Secret the pool names.
struct KeyFile<'a> {
    /// The conductor's flag naming the file (without `--`).
    flag: &'static str,
    /// Name of the volume.
    volume: &'static str,
    /// Directory the volume is mounted at.
    dir: &'static str,
    /// The file's name in that directory.
    file: &'static str,
    secret: &'a SecretKeyRef,
}

impl KeyFile<'_> {
    fn file_path(&self) -> String {
        format!("{}/{}", self.dir, self.file)
    }

    /// The Secret volume holding only the named key, as [`Self::file`], readable by the owner
    /// and the pod's group (the conductor runs as the `fsGroup` user, never as root).
    fn volume(&self) -> Volume {
        Volume {
            name: self.volume.to_owned(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(self.secret.name.clone()),
                default_mode: Some(0o440),
                items: Some(vec![KeyToPath {
                    key: self.secret.key.clone(),
                    path: self.file.to_owned(),
                    mode: None,
                }]),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        }
    }
}

/// Where the conductor's client API keys are mounted.
pub const API_KEYS_DIR: &str = "/etc/kvpool/conductor-api-keys";
/// Where the engines' API key is mounted.
pub const ENGINE_API_KEY_DIR: &str = "/etc/kvpool/engine-api-key";

/// The key files of `spec.conductor.apiKeySecret` and `engineApiKeySecret`, in that order.
fn key_files(c: &ConductorSpec) -> Vec<KeyFile<'_>> {
    let clients = c.api_key_secret.as_ref().map(|secret| KeyFile {
        flag: "api-key-file",
        volume: "api-keys",
        dir: API_KEYS_DIR,
        file: "keys",
        secret,
    });
    let engines = c.engine_api_key_secret.as_ref().map(|secret| KeyFile {
        flag: "engine-api-key-file",
        volume: "engine-api-key",
        dir: ENGINE_API_KEY_DIR,
        file: "key",
        secret,
    });
    clients.into_iter().chain(engines).collect()
}

/// Name of the conductor's volume of the engine pools' model claim.
const MODEL_VOLUME: &str = "model";

/// The directory of the model inside the conductor's mount of its claim.
fn model_dir(files: &ModelFiles) -> String {
    match files.path.as_str() {
        "" => contract::MODEL_MOUNT.to_owned(),
        path => format!("{}/{path}", contract::MODEL_MOUNT),
    }
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

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{Container, PodSpec};
    use kvpool_crd::SecretKeyRef;

    use crate::test_fixtures::{after, roce, valid};

    fn conductor_pod(pool: &kvpool_crd::KVCachePool) -> PodSpec {
        let (d, _) = super::conductor(&valid(pool), "h", &Default::default());
        d.spec.and_then(|s| s.template.spec).expect("conductor pod")
    }

    fn args(c: &Container) -> &[String] {
        c.args.as_deref().expect("args")
    }

    #[test]
    fn api_key_secrets_are_mounted_alone_and_passed_as_key_files() {
        let plain = conductor_pod(&roce());
        let c = &plain.containers[0];
        assert!(!args(c).iter().any(|a| a.contains("api-key-file")));
        assert!(
            !plain
                .volumes
                .iter()
                .flatten()
                .any(|v| v.name.contains("api-key"))
        );

        let mut pool = roce();
        pool.spec.conductor.api_key_secret = Some(SecretKeyRef {
            name: "conductor-keys".into(),
            key: "keys.txt".into(),
        });
        pool.spec.conductor.engine_api_key_secret = Some(SecretKeyRef {
            name: "vllm-api-key".into(),
            key: "token".into(),
        });
        let pod = conductor_pod(&pool);
        let c = &pod.containers[0];
        assert_eq!(
            after(args(c), "--api-key-file"),
            Some("/etc/kvpool/conductor-api-keys/keys")
        );
        assert_eq!(
            after(args(c), "--engine-api-key-file"),
            Some("/etc/kvpool/engine-api-key/key")
        );
        for (volume, secret, key, file, dir) in [
            (
                "api-keys",
                "conductor-keys",
                "keys.txt",
                "keys",
                super::API_KEYS_DIR,
            ),
            (
                "engine-api-key",
                "vllm-api-key",
                "token",
                "key",
                super::ENGINE_API_KEY_DIR,
            ),
        ] {
            let v = pod
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == volume)
                .unwrap_or_else(|| panic!("{volume} volume"));
            let s = v.secret.as_ref().expect("a Secret volume");
            assert_eq!(s.secret_name.as_deref(), Some(secret));
            // The named key only, group-readable for the non-root conductor (fsGroup).
            assert_eq!(s.default_mode, Some(0o440));
            let items: Vec<(&str, &str)> = s
                .items
                .iter()
                .flatten()
                .map(|i| (i.key.as_str(), i.path.as_str()))
                .collect();
            assert_eq!(items, [(key, file)]);
            let m = c
                .volume_mounts
                .iter()
                .flatten()
                .find(|m| m.name == volume)
                .unwrap_or_else(|| panic!("{volume} mount"));
            assert_eq!((m.mount_path.as_str(), m.read_only), (dir, Some(true)));
        }
    }

    /// The engine pools' facts: their tensor parallel size, and the claim holding their one
    /// model, mounted read-only where `--model-dir` points (the model directory's tokenizer
    /// then replaces the engines' /tokenize).
    #[test]
    fn the_engine_pools_model_claim_is_mounted_and_named_by_model_dir() {
        let facts = crate::serving::ConductorFacts {
            tensor_parallel_size: Some(2),
            model_files: Some(crate::serving::ModelFiles {
                claim: "weights".into(),
                path: "hub/qwen".into(),
            }),
        };
        let (d, _) = super::conductor(&valid(&roce()), "h", &facts);
        let pod = d.spec.and_then(|s| s.template.spec).expect("conductor pod");
        let c = &pod.containers[0];
        assert_eq!(
            after(args(c), "--model-dir"),
            Some("/etc/kvpool/model/hub/qwen")
        );
        assert_eq!(after(args(c), "--engine-tensor-parallel-size"), Some("2"));
        assert!(!args(c).iter().any(|a| a == "--tokenizer"), "{:?}", args(c));
        let v = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == "model")
            .expect("model volume");
        let claim = v.persistent_volume_claim.as_ref().expect("a claim");
        assert_eq!(
            (claim.claim_name.as_str(), claim.read_only),
            ("weights", Some(true))
        );
        let m = c
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == "model")
            .expect("model mount");
        assert_eq!(
            (m.mount_path.as_str(), m.read_only),
            ("/etc/kvpool/model", Some(true))
        );

        // Without facts: the engines' tokenizer, no size, no claim.
        let plain = conductor_pod(&roce());
        let c = &plain.containers[0];
        assert_eq!(after(args(c), "--tokenizer"), Some("engine"));
        assert!(
            !args(c)
                .iter()
                .any(|a| a == "--model-dir" || a == "--engine-tensor-parallel-size")
        );
        assert!(!plain.volumes.iter().flatten().any(|v| v.name == "model"));
    }
}
