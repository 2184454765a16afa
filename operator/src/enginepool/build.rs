//! Pure construction of an engine pool's children: one Deployment of engine instances and one
//! Service in front of them. The engine learns how to reach the pool from environment variables
//! and the mounted pool config (docs/engine-contract.md). I/O boundary: none.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, EnvVar, HTTPGetAction, PodSecurityContext, PodSpec,
    PodTemplateSpec, Probe, ResourceRequirements, Service, Volume,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kvpool_crd::EngineKind;

use super::validate::ValidEnginePool;
use crate::contract::{self, EngineLaunch, env};
use crate::labels;
use crate::pod::{self, KEY_READER_GROUP, field_env, mount, plain_env};

/// Children of an engine pool.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineChildren {
    pub deployment: Deployment,
    pub service: Service,
}

/// The named port of the engine container and Service.
const ENGINE_PORTS: [(&str, u16); 1] = [("http", contract::ENGINE_PORT)];

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
    kvpool_crd::labels::selector_string(&labels::selector_labels(
        &p.pool.name,
        &p.name,
        p.component,
    ))
}

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
        plain_env(env::SLO_MILLIS, p.effective.slo_millis.to_string()),
        plain_env(
            env::TENSOR_PARALLEL_SIZE,
            p.effective.tensor_parallel_size.to_string(),
        ),
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
    pod::add_extended_resources(&mut res, extended);
    (res != ResourceRequirements::default()).then_some(res)
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
        ports: Some(pod::ports(&ENGINE_PORTS)),
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
            selector: pod::label_selector(selector.clone()),
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
                    // Puts the engine's processes in the group that may read the auth key,
                    // whatever user the engine image runs as.
                    security_context: Some(PodSecurityContext {
                        fs_group: Some(KEY_READER_GROUP),
                        ..PodSecurityContext::default()
                    }),
                    containers: vec![container],
                    volumes: Some(vec![
                        pod::config_volume(&p.pool.name),
                        pod::auth_volume(&p.pool.name),
                        pod::socket_volume(),
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
    let service = pod::service(meta(p), selector, &ENGINE_PORTS);
    EngineChildren {
        deployment,
        service,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::enginepool::validate::validate;
    use crate::test_fixtures::{decode_sglang, prefill_custom, prefill_vllm, roce, tcp, valid};

    fn container(d: &Deployment) -> &Container {
        &d.spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .expect("pod")
            .containers[0]
    }

    fn env_value<'a>(c: &'a Container, name: &str) -> Option<&'a str> {
        c.env
            .as_ref()?
            .iter()
            .find(|e| e.name == name)
            .and_then(|e| e.value.as_deref())
    }

    #[test]
    fn vllm_prefill_gets_disaggregation_defaults_gpus_and_the_pool_contract() {
        let p = validate(&prefill_vllm(), valid(&roce())).expect("valid");
        let children = build(&p, "hash1");
        let d = &children.deployment;
        assert_eq!(d.metadata.name.as_deref(), Some("qwen-prefill"));
        let owner = &d.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str()),
            ("PrefillPool", "qwen")
        );
        let spec = d.spec.as_ref().expect("spec");
        assert_eq!(spec.replicas, Some(2));
        let pod = spec.template.spec.as_ref().expect("pod");
        assert_eq!(
            pod.node_selector
                .as_ref()
                .expect("kept on the pool's nodes")["nvidia.com/gpu.product"],
            "H100-SXM"
        );
        assert_eq!(pod.tolerations.as_ref().map(Vec::len), Some(1));
        assert_eq!(
            pod.security_context.as_ref().and_then(|s| s.fs_group),
            Some(crate::cachepool::build::KEY_READER_GROUP),
            "engines of any user can read the auth key"
        );

        let c = container(d);
        assert_eq!(c.image.as_deref(), Some("vllm/vllm-openai:v0.11.0"));
        assert_eq!(c.command.as_deref(), Some(&["vllm".to_owned()][..]));
        let args = c.args.as_deref().expect("args");
        assert_eq!(&args[..2], ["serve", "Qwen/Qwen3-32B"]);
        assert!(
            args.windows(2)
                .any(|w| w == ["--tensor-parallel-size", "4"])
        );
        let transfer = args
            .windows(2)
            .find(|w| w[0] == "--kv-transfer-config")
            .map(|w| w[1].clone())
            .expect("kv transfer config");
        let transfer: serde_json::Value = serde_json::from_str(&transfer).expect("valid JSON");
        assert_eq!(transfer["kv_role"], "kv_producer");
        assert_eq!(&args[args.len() - 2..], ["--max-model-len", "32768"]);

        assert_eq!(
            env_value(c, "KVPOOL_MASTER_ADDR"),
            Some("roce-master.llm.svc:50051")
        );
        assert_eq!(
            env_value(c, "KVPOOL_AGENT_SOCKET"),
            Some("/run/kvpool/agent.sock")
        );
        assert_eq!(env_value(c, "KVPOOL_ROLE"), Some("prefill"));
        assert_eq!(
            env_value(c, "KVPOOL_SLO_MILLIS"),
            Some("1000"),
            "the TTFT objective"
        );
        assert_eq!(env_value(c, "KVPOOL_TENSOR_PARALLEL_SIZE"), Some("4"));
        assert_eq!(
            env_value(c, "KVPOOL_AUTH_KEY_FILE"),
            Some("/etc/kvpool/auth/key")
        );
        assert_eq!(
            env_value(c, "MOONCAKE_CONFIG_PATH"),
            Some("/etc/kvpool/engine.json")
        );
        assert_eq!(env_value(c, "VLLM_LOGGING_LEVEL"), Some("DEBUG"));
        // The user's value replaces the operator's, without a duplicate entry.
        assert_eq!(env_value(c, "KVPOOL_BLOCK_SIZE_TOKENS"), Some("128"));
        let names: Vec<&str> = c
            .env
            .as_ref()
            .expect("env")
            .iter()
            .map(|e| e.name.as_str())
            .collect();
        let unique: std::collections::BTreeSet<&str> = names.iter().copied().collect();
        assert_eq!(unique.len(), names.len(), "duplicate env names: {names:?}");

        let res = c.resources.as_ref().expect("resources");
        let limits = res.limits.as_ref().expect("limits");
        let requests = res.requests.as_ref().expect("requests");
        assert_eq!(limits["nvidia.com/gpu"], Quantity("4".into()));
        assert_eq!(requests["nvidia.com/gpu"], Quantity("4".into()));
        assert_eq!(limits["nvidia.com/rdma_vf"], Quantity("1".into()));
        assert_eq!(requests["cpu"], Quantity("16".into()));

        let volumes = pod.volumes.as_ref().expect("volumes");
        let socket = volumes
            .iter()
            .find(|v| v.name == "socket")
            .and_then(|v| v.host_path.as_ref())
            .expect("socket hostPath");
        assert_eq!(socket.path, "/run/kvpool");
        assert!(volumes.iter().any(|v| v.name == "auth"
            && v.secret.as_ref().and_then(|s| s.secret_name.as_deref()) == Some("roce-auth")));
        assert!(volumes.iter().any(|v| v.name == "config"
            && v.config_map.as_ref().map(|c| c.name.as_str()) == Some("roce-config")));
        let annotations = spec
            .template
            .metadata
            .as_ref()
            .and_then(|m| m.annotations.as_ref())
            .expect("annotations");
        assert_eq!(annotations[labels::CONFIG_HASH], "hash1");
        assert_eq!(annotations[labels::ENGINE_PROTOCOL_ANNOTATION], "vllm");
        assert!(!annotations.contains_key(labels::BOOTSTRAP_PORT_ANNOTATION));
        assert!(c.readiness_probe.is_some());

        let svc = &children.service;
        assert_eq!(svc.metadata.name.as_deref(), Some("qwen-prefill"));
        let svc_spec = svc.spec.as_ref().expect("svc spec");
        assert_eq!(
            svc_spec.selector.as_ref(),
            spec.selector.match_labels.as_ref()
        );
        assert_eq!(svc_spec.ports.as_ref().expect("ports")[0].port, 8000);
        assert_eq!(
            selector_string(&p),
            "app.kubernetes.io/instance=qwen,app.kubernetes.io/name=kvpool,kvpool.dev/component=prefill,kvpool.dev/pool=roce"
        );
    }

    #[test]
    fn sglang_decode_uses_decode_mode_and_mooncake_backend() {
        let p = validate(&decode_sglang(), valid(&roce())).expect("valid");
        let children = build(&p, "h");
        assert_eq!(
            children.deployment.metadata.name.as_deref(),
            Some("qwen-decode")
        );
        let c = container(&children.deployment);
        assert_eq!(c.command.as_deref(), Some(&["python3".to_owned()][..]));
        let args = c.args.as_deref().expect("args");
        assert!(
            args.windows(2)
                .any(|w| w == ["--disaggregation-mode", "decode"])
        );
        assert!(
            args.windows(2)
                .any(|w| w == ["--disaggregation-transfer-backend", "mooncake"])
        );
        assert!(args.windows(2).any(|w| w == ["--tp-size", "2"]));
        assert_eq!(env_value(c, "KVPOOL_ROLE"), Some("decode"));
        assert_eq!(
            env_value(c, "KVPOOL_SLO_MILLIS"),
            Some("30"),
            "the TPOT objective"
        );
        assert_eq!(env_value(c, "MOONCAKE_CONFIG_PATH"), None, "vLLM only");
        let notes = pod_annotations(&p, "h");
        assert_eq!(notes[labels::ENGINE_PROTOCOL_ANNOTATION], "sglang");
        assert_eq!(notes[labels::BOOTSTRAP_PORT_ANNOTATION], "8998");
        let mut custom_port = decode_sglang();
        custom_port.spec.engine.args = vec!["--disaggregation-bootstrap-port=9100".to_owned()];
        let p = validate(&custom_port, valid(&roce())).expect("valid");
        let notes = pod_annotations(&p, "h");
        assert_eq!(notes[labels::BOOTSTRAP_PORT_ANNOTATION], "9100");
    }

    #[test]
    fn custom_engine_runs_exactly_what_the_user_wrote() {
        let p = validate(&prefill_custom(), valid(&tcp())).expect("valid");
        let c = container(&build(&p, "h").deployment).clone();
        assert_eq!(c.command.as_deref(), Some(&["kvpool".to_owned()][..]));
        assert_eq!(
            c.args.as_deref(),
            Some(
                &[
                    "engine".to_owned(),
                    "--role".to_owned(),
                    "prefill".to_owned()
                ][..]
            )
        );
        assert!(c.resources.is_none(), "0 GPUs and no RDMA: no resources");
        assert!(c.readiness_probe.is_none());
        assert_eq!(
            pod_annotations(&p, "h").keys().collect::<Vec<_>>(),
            [labels::CONFIG_HASH],
            "a custom engine declares no protocol"
        );
        assert_eq!(
            env_value(&c, "KVPOOL_MASTER_ADDR"),
            Some("tcp-master.default.svc:50051")
        );

        let mut no_command = prefill_custom();
        no_command.spec.engine.command.clear();
        no_command.spec.engine.args.clear();
        let p = validate(&no_command, valid(&tcp())).expect("valid");
        let c = container(&build(&p, "h").deployment).clone();
        assert!(
            c.command.is_none() && c.args.is_none(),
            "image entrypoint kept"
        );
    }

    #[test]
    fn invalid_engine_specs_name_the_field() {
        let mut odd = prefill_vllm();
        odd.spec.resources.gpus = 3;
        let err = validate(&odd, valid(&roce())).expect_err("3 GPUs with TP 4");
        assert!(err.to_string().contains("resources.gpus"), "{err}");
        assert!(err.is_invalid_spec());

        let mut dup = prefill_vllm();
        let first = dup.spec.engine.env[0].clone();
        dup.spec.engine.env.push(first);
        let err = validate(&dup, valid(&roce())).expect_err("duplicate env");
        assert!(err.to_string().contains("spec.engine.env"), "{err}");

        let mut long = prefill_vllm();
        long.metadata.name = Some("x".repeat(60));
        let err = validate(&long, valid(&roce())).expect_err("long name");
        assert!(err.to_string().contains("metadata.name"), "{err}");
    }
}
