//! Unit tests of [`super::build`] from the YAML fixtures: the engine Deployment and Service for
//! vLLM, SGLang and custom engines, the merge of `spec.template` under the operator's pod and
//! the `TemplateConflict` condition, and the validation errors that name the field.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Container;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::*;
use crate::enginepool::validate::validate;
use crate::test_fixtures::{
    after, assert_runs_kvpool, decode_sglang, has_arg, host_path, prefill_custom, prefill_vllm,
    roce, tcp, template_annotations, template_labels, valid,
};

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
    assert_eq!(
        pod.security_context
            .as_ref()
            .and_then(|s| s.seccomp_profile.as_ref())
            .map(|p| p.type_.as_str()),
        Some("RuntimeDefault")
    );

    let c = container(d);
    assert_eq!(c.image.as_deref(), Some("vllm/vllm-openai:v0.11.0"));
    // Least privilege for the user's image: no escalation, every capability dropped but
    // IPC_LOCK (buffer registration with the NIC).
    let security = c.security_context.as_ref().expect("securityContext");
    assert_eq!(security.allow_privilege_escalation, Some(false));
    assert_eq!(security.privileged, Some(false));
    let caps = security.capabilities.as_ref().expect("capabilities");
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]));
    assert_eq!(caps.add.as_deref(), Some(&["IPC_LOCK".to_owned()][..]));
    assert_eq!(c.command.as_deref(), Some(&["vllm".to_owned()][..]));
    let args = c.args.as_deref().expect("args");
    assert_eq!(&args[..2], ["serve", "Qwen/Qwen3-32B"]);
    assert!(has_arg(args, "--tensor-parallel-size", "4"));
    let transfer = after(args, "--kv-transfer-config").expect("kv transfer config");
    let transfer: serde_json::Value = serde_json::from_str(transfer).expect("valid JSON");
    // Prefill loads the pool's prefixes as well as saving (issue: prefill reuses the pool).
    assert_eq!(transfer["kv_role"], "kv_both");
    assert_eq!(transfer["kv_connector"], "KvpoolStoreConnector");
    assert_eq!(transfer["kv_connector_module_path"], "kvpool.adapters.vllm");
    assert_eq!(&args[args.len() - 2..], ["--max-model-len", "32768"]);

    assert_eq!(
        env_value(c, "KVPOOL_MASTER"),
        Some("roce-master.llm.svc:50051")
    );
    assert_eq!(
        env_value(c, "KVPOOL_AGENT_SOCKET"),
        Some("/run/kvpool/agent.sock")
    );
    assert_eq!(env_value(c, "KVPOOL_ROLE"), Some("prefill"));
    // The pool's transport.integrity reaches the engine's lanes (the default here).
    assert_eq!(env_value(c, "KVPOOL_TRANSFER_INTEGRITY"), Some("allow"));
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
    for name in ["KVPOOL_ENGINE_CONFIG", "MOONCAKE_CONFIG_PATH"] {
        assert_eq!(
            env_value(c, name),
            Some("/etc/kvpool/engine.json"),
            "{name}"
        );
    }
    assert_eq!(env_value(c, "PYTHONPATH"), Some("/opt/kvpool/python"));
    // One name per setting: the old names of the master address and the engine config are
    // gone from engine pods (the Python package still reads them, with a warning).
    assert_eq!(env_value(c, "KVPOOL_MASTER_ADDR"), None);
    assert_eq!(env_value(c, "KVPOOL_CONFIG"), None);
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
    let socket = host_path(volumes, "socket");
    assert_eq!(socket.path, "/run/kvpool");
    assert!(volumes.iter().any(|v| v.name == "auth"
        && v.secret.as_ref().and_then(|s| s.secret_name.as_deref()) == Some("roce-auth")));
    assert!(volumes.iter().any(|v| v.name == "config"
        && v.config_map.as_ref().map(|c| c.name.as_str()) == Some("roce-config")));
    let annotations = template_annotations(&spec.template);
    assert_eq!(annotations[labels::CONFIG_HASH], "hash1");
    assert_eq!(annotations[labels::ENGINE_PROTOCOL_ANNOTATION], "vllm");
    assert!(!annotations.contains_key(labels::BOOTSTRAP_PORT_ANNOTATION));
    assert!(c.readiness_probe.is_some());

    // The Python package: copied by an init container from the kvpool image into an emptyDir
    // that the engine mounts read-only where PYTHONPATH points.
    let init = &pod.init_containers.as_ref().expect("init containers")[0];
    assert_eq!(init.image.as_deref(), Some(p.pool.master_image.as_str()));
    assert_runs_kvpool(
        init,
        "operator install-python --from /opt/kvpool/python --to /mnt/kvpool-python",
    );
    let init_mount = &init.volume_mounts.as_ref().expect("init mounts")[0];
    assert_eq!(
        (init_mount.mount_path.as_str(), init_mount.read_only),
        ("/mnt/kvpool-python", None)
    );
    let engine_mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == init_mount.name)
        .expect("the engine mounts the package volume");
    assert_eq!(
        (engine_mount.mount_path.as_str(), engine_mount.read_only),
        ("/opt/kvpool/python", Some(true))
    );
    assert!(
        volumes
            .iter()
            .any(|v| v.name == init_mount.name && v.empty_dir.is_some())
    );

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
        "app.kubernetes.io/name=kvpool,kvpool.dev/component=prefill,kvpool.dev/instance=qwen,kvpool.dev/pool=roce"
    );
    // No child carries Argo CD's tracking label (it would be taken for an Application's).
    let labels = d.metadata.labels.as_ref().expect("labels");
    assert!(
        !labels.contains_key("app.kubernetes.io/instance"),
        "{labels:?}"
    );
    let pod_labels = spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.as_ref())
        .expect("pod labels");
    assert!(
        !pod_labels.contains_key("app.kubernetes.io/instance"),
        "{pod_labels:?}"
    );
}

#[test]
fn sglang_decode_uses_decode_mode_mooncake_hand_off_and_kvpool_storage() {
    let p = validate(&decode_sglang(), valid(&roce())).expect("valid");
    let children = build(&p, "h");
    assert_eq!(
        children.deployment.metadata.name.as_deref(),
        Some("qwen-decode")
    );
    let c = container(&children.deployment);
    assert_eq!(c.command.as_deref(), Some(&["python3".to_owned()][..]));
    let args = c.args.as_deref().expect("args");
    assert!(has_arg(args, "--disaggregation-mode", "decode"));
    assert!(has_arg(
        args,
        "--disaggregation-transfer-backend",
        "mooncake"
    ));
    assert!(has_arg(args, "--tp-size", "2"));
    assert!(has_arg(args, "--hicache-storage-backend", "dynamic"));
    assert!(
        args.iter()
            .any(|a| a == "--disaggregation-decode-enable-offload-kvcache")
    );
    assert_eq!(env_value(c, "KVPOOL_ROLE"), Some("decode"));
    assert_eq!(
        env_value(c, "KVPOOL_SLO_MILLIS"),
        Some("30"),
        "the TPOT objective"
    );
    assert_eq!(
        env_value(c, "MOONCAKE_CONFIG_PATH"),
        Some("/etc/kvpool/engine.json"),
        "every kind"
    );
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
    assert_runs_kvpool(&c, "engine --role prefill");
    assert!(c.resources.is_none(), "0 GPUs and no RDMA: no resources");
    assert!(c.readiness_probe.is_none());
    assert_eq!(
        pod_annotations(&p, "h").keys().collect::<Vec<_>>(),
        [labels::CONFIG_HASH],
        "a custom engine declares no protocol"
    );
    assert_eq!(
        env_value(&c, "KVPOOL_MASTER"),
        Some("tcp-master.default.svc:50051")
    );
    assert_eq!(env_value(&c, "PYTHONPATH"), Some("/opt/kvpool/python"));

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

#[test]
fn a_users_pythonpath_comes_after_the_package() {
    let mut pool = prefill_vllm();
    pool.spec
        .engine
        .env
        .push(k8s_openapi::api::core::v1::EnvVar {
            name: "PYTHONPATH".to_owned(),
            value: Some("/workspace/plugins".to_owned()),
            ..Default::default()
        });
    let p = validate(&pool, valid(&roce())).expect("valid");
    let c = container(&build(&p, "h").deployment).clone();
    assert_eq!(
        env_value(&c, "PYTHONPATH"),
        Some("/opt/kvpool/python:/workspace/plugins")
    );
    let count = c
        .env
        .iter()
        .flatten()
        .filter(|e| e.name == "PYTHONPATH")
        .count();
    assert_eq!(count, 1);
}

#[test]
fn engines_of_a_pool_with_master_tls_trust_its_ca() {
    let mut pool = roce();
    pool.spec.master.tls = Some(kvpool_crd::MasterTlsSpec {
        secret_name: "roce-master-tls".into(),
        client_secret_name: None,
        server_name: Some("master.kvpool.example".into()),
    });
    let p = validate(&prefill_vllm(), valid(&pool)).expect("valid");
    let d = build(&p, "hash1").deployment;
    let c = container(&d);
    assert_eq!(
        env_value(c, "KVPOOL_MASTER_CA_FILE"),
        Some("/etc/kvpool/master-tls/ca.crt")
    );
    assert_eq!(
        env_value(c, "KVPOOL_MASTER_SERVER_NAME"),
        Some("master.kvpool.example")
    );
    assert_eq!(env_value(c, "KVPOOL_MASTER_CLIENT_CERT_FILE"), None);
    let plain = validate(&prefill_vllm(), valid(&roce())).expect("valid");
    assert_eq!(
        env_value(
            container(&build(&plain, "hash1").deployment),
            "KVPOOL_MASTER_CA_FILE"
        ),
        None
    );
}

#[test]
fn engines_of_a_pool_with_transfer_tls_verify_the_agents_with_its_ca_only() {
    let mut pool = roce();
    pool.spec.transport.tls = Some(kvpool_crd::TransferTlsSpec {
        mode: kvpool_crd::TransferTlsMode::Require,
        secret_name: "roce-transfer-tls".into(),
        server_name: None,
    });
    let p = validate(&prefill_vllm(), valid(&pool)).expect("valid");
    let d = build(&p, "hash1").deployment;
    let c = container(&d);
    assert_eq!(env_value(c, "KVPOOL_TRANSFER_TLS"), Some("require"));
    assert_eq!(
        env_value(c, "KVPOOL_TRANSFER_CA_FILE"),
        Some("/etc/kvpool/transfer-tls/ca.crt")
    );
    let name = format!("{}-transfer.{}.svc", p.pool.name, p.pool.namespace);
    assert_eq!(
        env_value(c, "KVPOOL_TRANSFER_SERVER_NAME"),
        Some(name.as_str())
    );
    // The engine pod mounts the CA alone: never the agents' key.
    let pod = d
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod");
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "transfer-tls")
        .expect("transfer-tls volume");
    let secret = volume.secret.as_ref().expect("secret volume");
    assert_eq!(secret.secret_name.as_deref(), Some("roce-transfer-tls"));
    let items: Vec<&str> = secret
        .items
        .iter()
        .flatten()
        .map(|i| i.key.as_str())
        .collect();
    assert_eq!(items, ["ca.crt"]);
    assert!(
        c.volume_mounts
            .iter()
            .flatten()
            .any(|m| m.name == "transfer-tls" && m.mount_path == "/etc/kvpool/transfer-tls"),
        "{:?}",
        c.volume_mounts
    );
    let plain = validate(&prefill_vllm(), valid(&roce())).expect("valid");
    assert_eq!(
        env_value(
            container(&build(&plain, "hash1").deployment),
            "KVPOOL_TRANSFER_TLS"
        ),
        None
    );
}

#[test]
fn engine_pods_admit_the_pools_pods_and_outside_callers_only_as_the_spec_says() {
    let ports = |r: &k8s_openapi::api::networking::v1::NetworkPolicyIngressRule| -> Vec<String> {
        r.ports
            .iter()
            .flatten()
            .map(|p| format!("{:?}", p.port))
            .collect()
    };
    // A pool with a conductor: every port from the pool's own pods, nothing else.
    let p = validate(&prefill_vllm(), valid(&roce())).expect("valid");
    let policy = build(&p, "h").network_policy.expect("policy");
    let spec = policy.spec.as_ref().expect("spec");
    let selector = spec
        .pod_selector
        .as_ref()
        .and_then(|s| s.match_labels.clone())
        .expect("selector");
    assert_eq!(
        selector,
        crate::labels::selector_labels(&p.pool.name, &p.name, p.component)
    );
    let rules = spec.ingress.as_deref().expect("rules");
    assert_eq!(rules.len(), 1, "{rules:?}");
    assert!(rules[0].ports.is_none(), "every port from the pool's pods");
    let from = rules[0].from.as_deref().expect("from");
    let labels = from[0]
        .pod_selector
        .as_ref()
        .and_then(|s| s.match_labels.clone())
        .expect("pool pods");
    assert_eq!(labels["kvpool.dev/pool"], p.pool.name);
    assert!(
        from[0].namespace_selector.is_none(),
        "the pool's namespace only"
    );

    // Named callers and scrapers: the API port from each.
    let mut named = roce();
    named.spec.network_policy.engine_from = vec![kvpool_crd::EnginePeer {
        namespace_selector: Some(Default::default()),
        ..Default::default()
    }];
    named.spec.network_policy.metrics_from = vec![kvpool_crd::MetricsPeer {
        pod_selector: Some(Default::default()),
        ..Default::default()
    }];
    let p = validate(&prefill_vllm(), valid(&named)).expect("valid");
    let policy = build(&p, "h").network_policy.expect("policy");
    let rules = policy.spec.and_then(|s| s.ingress).expect("rules");
    assert_eq!(rules.len(), 3, "{rules:?}");
    assert_eq!(ports(&rules[1]), ["Some(Int(8000))"]);
    assert_eq!(ports(&rules[2]), ["Some(Int(8000))"]);

    // No conductor and nobody named: the namespace's pods may call the engines.
    let p = validate(&prefill_vllm(), valid(&tcp())).expect("valid");
    let rules = build(&p, "h")
        .network_policy
        .and_then(|n| n.spec)
        .and_then(|s| s.ingress)
        .expect("rules");
    assert_eq!(rules.len(), 2, "{rules:?}");
    let from = rules[1].from.as_deref().expect("from");
    assert_eq!(from[0].pod_selector, Some(Default::default()));

    // Policies off: none.
    let mut off = roce();
    off.spec.network_policy.enabled = false;
    let p = validate(&prefill_vllm(), valid(&off)).expect("valid");
    assert!(build(&p, "h").network_policy.is_none());
}

/// `spec.template` of the fixture PrefillPool, from YAML (indented as below `template:`).
fn with_template(yaml: &str) -> kvpool_crd::PrefillPool {
    let mut pool = prefill_vllm();
    pool.spec.template = Some(serde_saphyr::from_str(yaml).expect("template parses"));
    pool
}

fn pod_spec(d: &Deployment) -> &k8s_openapi::api::core::v1::PodSpec {
    d.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod")
}

const REAL_VLLM_TEMPLATE: &str = "
metadata:
  labels: {team: ml}
  annotations: {example.com/owner: ml-platform}
spec:
  imagePullSecrets: [{name: engine-registry}]
  volumes:
    - name: model-cache
      persistentVolumeClaim: {claimName: hf-cache}
  containers:
    - name: engine
      volumeMounts: [{name: model-cache, mountPath: /root/.cache/huggingface}]
      env: [{name: HF_HUB_OFFLINE, value: '1'}]
      startupProbe: {httpGet: {path: /health, port: http}, failureThreshold: 120, periodSeconds: 10}
    - name: log-shipper
      image: fluent/fluent-bit:3.1
  initContainers:
    - name: fetch-model
      image: registry.example.com/fetch:1
  tolerations:
    - {key: dedicated, operator: Equal, value: inference, effect: NoSchedule}
  affinity:
    nodeAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        nodeSelectorTerms:
          - matchExpressions:
              - {key: nvidia.com/gpu.memory, operator: Gt, values: ['80000']}
  serviceAccountName: engines
  priorityClassName: inference-high
  runtimeClassName: nvidia
  terminationGracePeriodSeconds: 120
  securityContext: {runAsUser: 1000, supplementalGroups: [44]}
";

/// The merge adds what the template adds and keeps everything the operator put there: the
/// real-engine case of issue 34 (a model-cache claim, a pull secret, a toleration, an affinity).
#[test]
fn a_template_adds_volumes_mounts_sidecars_and_scheduling_under_the_operators_pod() {
    let mut pool = roce();
    pool.spec.image_pull_secrets = vec![k8s_openapi::api::core::v1::LocalObjectReference {
        name: "kvpool-registry".into(),
    }];
    let plain = build(
        &validate(&prefill_vllm(), valid(&pool)).expect("valid"),
        "h",
    );
    let p = validate(&with_template(REAL_VLLM_TEMPLATE), valid(&pool)).expect("valid");
    let children = build(&p, "h");
    assert_eq!(children.template_conflicts, Vec::<String>::new());
    let d = &children.deployment;
    let pod = pod_spec(d);

    // Containers: the engine first, merged; then the sidecar.
    let names: Vec<&str> = pod.containers.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["engine", "log-shipper"]);
    let engine = container(d);
    let before = container(&plain.deployment);
    assert_eq!(engine.image, before.image);
    assert_eq!(engine.command, before.command);
    assert_eq!(engine.args, before.args);
    assert_eq!(engine.readiness_probe, before.readiness_probe);
    assert_eq!(engine.security_context, before.security_context);
    assert_eq!(engine.resources, before.resources);
    assert!(
        engine.startup_probe.is_some(),
        "the template's startup probe"
    );
    let mounts: Vec<(&str, &str)> = engine
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| (m.name.as_str(), m.mount_path.as_str()))
        .collect();
    let operator_mounts = before.volume_mounts.as_ref().expect("mounts").len();
    assert_eq!(mounts.len(), operator_mounts + 1, "{mounts:?}");
    assert_eq!(
        mounts.last(),
        Some(&("model-cache", "/root/.cache/huggingface"))
    );
    assert_eq!(env_value(engine, "HF_HUB_OFFLINE"), Some("1"));
    assert_eq!(env_value(engine, "KVPOOL_ROLE"), Some("prefill"));
    assert_eq!(
        engine.env.as_ref().map(Vec::len),
        before.env.as_ref().map(|e| e.len() + 1)
    );

    // Init containers: the operator's first.
    let init: Vec<&str> = pod
        .init_containers
        .iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(init, ["kvpool-python", "fetch-model"]);

    // Volumes: the operator's, then the claim.
    let volumes = pod.volumes.as_ref().expect("volumes");
    let last = volumes.last().expect("a volume");
    assert_eq!(
        last.persistent_volume_claim
            .as_ref()
            .map(|c| c.claim_name.as_str()),
        Some("hf-cache")
    );
    assert_eq!(
        volumes.len(),
        pod_spec(&plain.deployment)
            .volumes
            .as_ref()
            .map_or(0, Vec::len)
            + 1
    );

    // Pull secrets: the pool's (for the kvpool init container) and the template's.
    let secrets: Vec<&str> = pod
        .image_pull_secrets
        .iter()
        .flatten()
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(secrets, ["kvpool-registry", "engine-registry"]);

    // Scheduling: the pool's node selector and toleration stay, the template's are added.
    assert_eq!(
        pod.node_selector.as_ref().expect("selector")["nvidia.com/gpu.product"],
        "H100-SXM"
    );
    let tolerations: Vec<Option<&str>> = pod
        .tolerations
        .iter()
        .flatten()
        .map(|t| t.key.as_deref())
        .collect();
    assert_eq!(tolerations, [Some("nvidia.com/gpu"), Some("dedicated")]);
    let term = &pod
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .expect("required node affinity")
        .node_selector_terms[0];
    assert_eq!(
        term.match_expressions.as_ref().expect("expressions")[0].key,
        "nvidia.com/gpu.memory"
    );
    assert_eq!(pod.service_account_name.as_deref(), Some("engines"));
    assert_eq!(
        pod.automount_service_account_token,
        Some(false),
        "no token unless asked"
    );
    assert_eq!(pod.priority_class_name.as_deref(), Some("inference-high"));
    assert_eq!(pod.runtime_class_name.as_deref(), Some("nvidia"));
    assert_eq!(pod.termination_grace_period_seconds, Some(120));
    let security = pod.security_context.as_ref().expect("security context");
    assert_eq!(security.run_as_user, Some(1000));
    assert_eq!(security.supplemental_groups.as_deref(), Some(&[44][..]));
    assert_eq!(
        security.fs_group,
        Some(crate::cachepool::build::KEY_READER_GROUP)
    );
    assert!(security.seccomp_profile.is_some());

    // Pod metadata: the template's label and annotation next to the operator's; the
    // Deployment's own labels and selector are the operator's alone.
    let template = &d.spec.as_ref().expect("spec").template;
    assert_eq!(template_labels(template)["team"], "ml");
    assert_eq!(template_labels(template)["kvpool.dev/pool"], "roce");
    assert_eq!(
        template_annotations(template)["example.com/owner"],
        "ml-platform"
    );
    assert_eq!(template_annotations(template)[labels::CONFIG_HASH], "h");
    assert!(
        !d.metadata
            .labels
            .as_ref()
            .expect("labels")
            .contains_key("team")
    );
    assert_eq!(
        d.spec.as_ref().map(|s| &s.selector),
        plain.deployment.spec.as_ref().map(|s| &s.selector)
    );
    // Without a template the pool's pods are what they were.
    assert!(plain.template_conflicts.is_empty());
}

/// Every field the operator owns keeps the operator's value, and the conflict names the
/// template's field.
#[test]
fn operator_owned_fields_win_and_each_conflict_names_the_templates_field() {
    let p = validate(
        &with_template(
            "
metadata:
  labels: {kvpool.dev/pool: other, team: ml}
  annotations: {kvpool.dev/engine-protocol: sglang}
spec:
  volumes:
    - {name: auth, emptyDir: {}}
    - {name: models, emptyDir: {}}
  containers:
    - name: engine
      image: evil/engine:latest
      command: [sh]
      securityContext: {privileged: true}
      env: [{name: KVPOOL_ROLE, value: decode}, {name: VLLM_LOGGING_LEVEL, value: DEBUG}]
      ports: [{name: http, containerPort: 9000}, {name: metrics, containerPort: 8001}]
      volumeMounts:
        - {name: models, mountPath: /etc/kvpool/auth}
        - {name: models, mountPath: /models}
      resources: {limits: {nvidia.com/gpu: '8', memory: 300Gi}}
  initContainers:
    - {name: kvpool-python, image: busybox}
  nodeSelector: {nvidia.com/gpu.product: A100, zone: a}
  automountServiceAccountToken: true
  securityContext: {fsGroup: 0}
",
        ),
        valid(&roce()),
    )
    .expect("valid");
    let children = build(&p, "h");
    let conflicts = &children.template_conflicts;
    let expected = [
        "spec.template.metadata.annotations[\"kvpool.dev/engine-protocol\"]",
        "spec.template.metadata.labels[\"kvpool.dev/pool\"]",
        "spec.template.spec.containers[engine].command",
        "spec.template.spec.containers[engine].env[KVPOOL_ROLE]",
        "spec.template.spec.containers[engine].image",
        "spec.template.spec.containers[engine].ports[http]",
        "spec.template.spec.containers[engine].resources.limits[\"nvidia.com/gpu\"]",
        "spec.template.spec.containers[engine].securityContext.privileged",
        "spec.template.spec.containers[engine].volumeMounts[/etc/kvpool/auth]",
        "spec.template.spec.initContainers[kvpool-python]",
        "spec.template.spec.nodeSelector[\"nvidia.com/gpu.product\"]",
        "spec.template.spec.securityContext.fsGroup",
        "spec.template.spec.volumes[auth]",
    ];
    let mut found: Vec<&str> = conflicts.iter().map(String::as_str).collect();
    found.sort_unstable();
    let mut wanted = expected.to_vec();
    wanted.sort_unstable();
    assert_eq!(found, wanted);
    // A value the user repeats exactly is no conflict (the env of spec.engine.env).
    assert!(
        !conflicts.iter().any(|c| c.contains("VLLM_LOGGING_LEVEL")),
        "{conflicts:?}"
    );

    let d = &children.deployment;
    let pod = pod_spec(d);
    let c = container(d);
    assert_eq!(c.image.as_deref(), Some("vllm/vllm-openai:v0.11.0"));
    assert_eq!(c.command.as_deref(), Some(&["vllm".to_owned()][..]));
    assert_eq!(
        c.security_context.as_ref().and_then(|s| s.privileged),
        Some(false)
    );
    assert_eq!(env_value(c, "KVPOOL_ROLE"), Some("prefill"));
    let res = c.resources.as_ref().expect("resources");
    let limits = res.limits.as_ref().expect("limits");
    assert_eq!(limits["nvidia.com/gpu"], Quantity("4".into()));
    assert_eq!(
        limits["memory"],
        Quantity("300Gi".into()),
        "a resource the operator does not set is the template's"
    );
    let ports: Vec<(Option<&str>, i32)> = c
        .ports
        .iter()
        .flatten()
        .map(|p| (p.name.as_deref(), p.container_port))
        .collect();
    assert_eq!(ports, [(Some("http"), 8000), (Some("metrics"), 8001)]);
    let auth_mounts: Vec<&str> = c
        .volume_mounts
        .iter()
        .flatten()
        .filter(|m| m.mount_path == "/etc/kvpool/auth")
        .map(|m| m.name.as_str())
        .collect();
    assert_eq!(auth_mounts, ["auth"]);
    assert!(
        c.volume_mounts
            .iter()
            .flatten()
            .any(|m| m.mount_path == "/models")
    );
    let auth = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "auth")
        .expect("auth");
    assert!(auth.secret.is_some(), "the pool's key, not the template's");
    let init: Vec<(&str, Option<&str>)> = pod
        .init_containers
        .iter()
        .flatten()
        .map(|c| (c.name.as_str(), c.image.as_deref()))
        .collect();
    assert_eq!(
        init,
        [("kvpool-python", Some(p.pool.master_image.as_str()))]
    );
    let selector = pod.node_selector.as_ref().expect("selector");
    assert_eq!(selector["nvidia.com/gpu.product"], "H100-SXM");
    assert_eq!(selector["zone"], "a");
    assert_eq!(
        pod.security_context.as_ref().and_then(|s| s.fs_group),
        Some(crate::cachepool::build::KEY_READER_GROUP)
    );
    let template = &d.spec.as_ref().expect("spec").template;
    assert_eq!(template_labels(template)["kvpool.dev/pool"], "roce");
    assert_eq!(template_labels(template)["team"], "ml");
    assert_eq!(
        template_annotations(template)[labels::ENGINE_PROTOCOL_ANNOTATION],
        "vllm"
    );
    // Defaults the template may replace: the API token.
    assert_eq!(pod.automount_service_account_token, Some(true));

    // The containers and init containers of a pod share their names.
    let p = validate(
        &with_template("spec:\n  initContainers: [{name: engine, image: busybox}]\n"),
        valid(&roce()),
    )
    .expect("valid");
    let children = build(&p, "h");
    assert_eq!(
        children.template_conflicts,
        ["spec.template.spec.initContainers[engine]"]
    );
    assert_eq!(
        pod_spec(&children.deployment)
            .init_containers
            .as_ref()
            .map(Vec::len),
        Some(1)
    );
}

/// `shm` is the operator's default for `/dev/shm`: a template's volume of that name replaces
/// it (to bound it), and the engine's mount of it stays. A custom engine has no readiness
/// probe of the operator's, so the template's is kept; values equal to the operator's are no
/// conflict.
#[test]
fn shm_and_the_probes_the_operator_leaves_unset_are_the_templates() {
    let mut custom = prefill_custom();
    custom.spec.template = Some(
        serde_saphyr::from_str(
            "
metadata: {labels: {kvpool.dev/pool: tcp}}
spec:
  volumes: [{name: shm, emptyDir: {medium: Memory, sizeLimit: 16Gi}}]
  containers:
    - name: engine
      readinessProbe: {httpGet: {path: /ready, port: 8000}}
      volumeMounts: [{name: shm, mountPath: /dev/shm}]
",
        )
        .expect("parses"),
    );
    let p = validate(&custom, valid(&tcp())).expect("valid");
    let children = build(&p, "h");
    assert_eq!(children.template_conflicts, Vec::<String>::new());
    let pod = pod_spec(&children.deployment);
    let shm = pod
        .volumes
        .iter()
        .flatten()
        .filter(|v| v.name == SHM_VOLUME)
        .collect::<Vec<_>>();
    assert_eq!(shm.len(), 1);
    assert_eq!(
        shm[0].empty_dir.as_ref().and_then(|e| e.size_limit.clone()),
        Some(Quantity("16Gi".into()))
    );
    let c = container(&children.deployment);
    let probe = c.readiness_probe.as_ref().expect("the template's probe");
    assert_eq!(
        probe.http_get.as_ref().and_then(|h| h.path.as_deref()),
        Some("/ready")
    );
    let shm_mounts = c
        .volume_mounts
        .iter()
        .flatten()
        .filter(|m| m.mount_path == "/dev/shm")
        .count();
    assert_eq!(shm_mounts, 1);
}

#[test]
fn template_names_used_twice_are_invalid_and_name_the_field() {
    let twice = with_template(
        "spec:\n  containers: [{name: sidecar, image: a}]\n  initContainers: [{name: sidecar, image: b}]\n",
    );
    let err = validate(&twice, valid(&roce())).expect_err("one name twice in a pod");
    assert!(
        err.to_string()
            .contains("spec.template.spec.initContainers"),
        "{err}"
    );
    assert!(err.is_invalid_spec());
    let volumes =
        with_template("spec:\n  volumes: [{name: a, emptyDir: {}}, {name: a, emptyDir: {}}]\n");
    let err = validate(&volumes, valid(&roce())).expect_err("a volume twice");
    assert!(
        err.to_string().contains("spec.template.spec.volumes"),
        "{err}"
    );
    let label = with_template("metadata: {labels: {team: 'a b'}}\n");
    let err = validate(&label, valid(&roce())).expect_err("a bad label value");
    assert!(
        err.to_string().contains("spec.template.metadata.labels"),
        "{err}"
    );
}

/// The pool's pull secrets reach the engine pods (their init container runs the kvpool image)
/// even without a template.
#[test]
fn the_pools_pull_secrets_reach_the_engine_pods() {
    let mut pool = tcp();
    pool.spec.image_pull_secrets = vec![k8s_openapi::api::core::v1::LocalObjectReference {
        name: "kvpool-registry".into(),
    }];
    let p = validate(&prefill_custom(), valid(&pool)).expect("valid");
    let pod = pod_spec(&build(&p, "h").deployment).clone();
    let secrets: Vec<String> = pod
        .image_pull_secrets
        .into_iter()
        .flatten()
        .map(|s| s.name)
        .collect();
    assert_eq!(secrets, ["kvpool-registry"]);
    let p = validate(&prefill_custom(), valid(&tcp())).expect("valid");
    assert!(
        pod_spec(&build(&p, "h").deployment)
            .image_pull_secrets
            .is_none()
    );
}

#[test]
fn the_template_conflict_condition_names_the_fields_and_reports_each_change_once() {
    use crate::enginepool::status::{new_template_conflict, template_condition};
    let clean = template_condition(&[]);
    assert_eq!(
        (clean.type_, clean.status, clean.reason),
        ("TemplateConflict", false, "TemplateApplied")
    );
    let fields: Vec<String> = (0..10).map(|i| format!("spec.template.f{i}")).collect();
    let c = template_condition(&fields[..2]);
    assert_eq!((c.status, c.reason), (true, "OperatorOwnedFields"));
    assert!(
        c.message.contains("spec.template.f0, spec.template.f1"),
        "{}",
        c.message
    );
    let many = template_condition(&fields);
    assert!(many.message.contains("f7 and 2 more"), "{}", many.message);
    assert!(!many.message.contains("f8"), "{}", many.message);

    let status = |conflicts: &[String]| kvpool_crd::EnginePoolStatus {
        conditions: crate::conditions::merge(
            &[],
            &[template_condition(conflicts)],
            Some(1),
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ),
        ..Default::default()
    };
    let none = status(&[]);
    let two = status(&fields[..2]);
    let three = status(&fields[..3]);
    assert_eq!(new_template_conflict(None, &none), None);
    assert_eq!(new_template_conflict(Some(&none), &none), None);
    assert!(new_template_conflict(None, &two).is_some());
    assert!(new_template_conflict(Some(&none), &two).is_some());
    assert_eq!(new_template_conflict(Some(&two), &two), None, "once");
    assert!(
        new_template_conflict(Some(&two), &three).is_some(),
        "changed"
    );
    assert_eq!(new_template_conflict(Some(&two), &none), None);
}
