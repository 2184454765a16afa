//! Unit tests of [`super::build`] from the YAML fixtures: assertions on the DaemonSet,
//! Deployments, Services, ConfigMap, Secret and RBAC objects it returns.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{PodSpec, ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kvpool_crd::ValidatedKVCachePool;

use super::*;
use crate::labels::{self, Component};
use crate::test_fixtures::{
    after, assert_runs_kvpool, has_arg, host_path, roce, tcp, template_annotations,
    template_labels, valid,
};

fn pod(ds: &DaemonSet) -> &PodSpec {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec")
}

fn q(s: &str) -> Quantity {
    Quantity(s.to_owned())
}

/// The children of the `roce` fixture.
fn roce_children() -> CachePoolChildren {
    build(&valid(&roce()), "00ff").expect("build")
}

#[test]
fn roce_agent_daemonset_carries_every_node_level_setting() {
    let children = roce_children();
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
    let template_labels = template_labels(&spec.template);
    for (k, v) in selector {
        assert_eq!(template_labels.get(k), Some(v), "selector label {k}");
    }
    let annotations = template_annotations(&spec.template);
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
    assert_runs_kvpool(
        c,
        "agent run --pool-config /etc/kvpool/config.yaml --admin-listen 0.0.0.0:9090
        --socket-dir /run/kvpool --node-name $(KVPOOL_NODE_NAME)
        --advertise-host $(KVPOOL_POD_IP)",
    );
    // Least privilege: every capability dropped but the two the agent uses, no escalation, a
    // read-only root filesystem, RuntimeDefault seccomp, and the engines' group as a
    // supplementary group (for handing them the socket without CAP_CHOWN).
    let security = c.security_context.as_ref().expect("securityContext");
    let caps = security.capabilities.as_ref().expect("capabilities");
    assert_eq!(
        caps.add.as_deref(),
        Some(&["IPC_LOCK".to_owned(), "SYS_NICE".to_owned()][..])
    );
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]));
    assert_eq!(security.allow_privilege_escalation, Some(false));
    assert_eq!(security.read_only_root_filesystem, Some(true));
    assert_eq!(security.privileged, Some(false));
    let pod_security = pod.security_context.as_ref().expect("pod securityContext");
    assert_eq!(
        pod_security
            .seccomp_profile
            .as_ref()
            .map(|p| p.type_.as_str()),
        Some("RuntimeDefault")
    );
    assert_eq!(
        pod_security.supplemental_groups.as_deref(),
        Some(&[i64::from(kvpool_crd::POOL_CLIENT_GROUP)][..])
    );
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
    // The one writable place outside the volumes, on a read-only root filesystem.
    assert!(mounts.contains(&("tmp", "/tmp")));
    assert!(find("tmp").empty_dir.is_some());
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
    assert_eq!(volumes, ["config", "auth", "socket", "tmp"]);
    assert!(children.conductor.is_none());
    // Without a ServiceAccount for the agents, no API token reaches them.
    assert_eq!(pod.service_account_name, None);
    assert_eq!(pod.automount_service_account_token, Some(false));
}

#[test]
fn agents_run_as_the_named_service_account_with_its_token() {
    let mut spec = tcp();
    spec.spec.agent.service_account_name = Some("kvpool-agent".into());
    spec.spec.replication.spread_label_key = "topology.kubernetes.io/zone".into();
    let children = build(&valid(&spec), "00ff").expect("build");
    let pod = pod(&children.agent);
    assert_eq!(pod.service_account_name.as_deref(), Some("kvpool-agent"));
    assert_eq!(pod.automount_service_account_token, Some(true));
    // The agents learn the label from the pool document; the master spreads over it.
    let config = &children.config.data.as_ref().expect("data")[crate::contract::CONFIG_FILE_KEY];
    assert!(
        config.contains("spreadLabelKey: topology.kubernetes.io/zone"),
        "{config}"
    );
    let master = children
        .master
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .map(|p| p.containers[0].args.clone().unwrap_or_default())
        .expect("master args");
    assert!(
        has_arg(&master, "--replica-spread", "failure-domain"),
        "{master:?}"
    );
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
    let children = roce_children();
    let master = &children.master;
    assert_eq!(master.metadata.name.as_deref(), Some("roce-master"));
    let spec = master.spec.as_ref().expect("spec");
    assert_eq!(spec.replicas, Some(3));
    let c = &spec.template.spec.as_ref().expect("pod").containers[0];
    // The eviction flags follow the fixture's spec.eviction: lfu at 95 / 85 percent.
    assert_runs_kvpool(
        c,
        r#"master --listen 0.0.0.0:50051 --admin-listen 0.0.0.0:9090
        --auth-key-file /etc/kvpool/auth/key
        --kv-events-config {"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","publisher":"zmq","replay_endpoint":"tcp://*:5558","topic":"kvpool"}
        --eviction-policy lfu
        --dram-high-watermark 0.95 --dram-low-watermark 0.85
        --ssd-high-watermark 0.95 --ssd-low-watermark 0.85
        --replica-spread failure-domain --shared-agent-credentials
        --etcd-endpoints http://etcd-0.etcd:2379,http://etcd-1.etcd:2379
        --advertise-addr $(KVPOOL_POD_IP):50051"#,
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
    assert_eq!(
        ports,
        [
            (Some("grpc"), 50051),
            (Some("admin"), 9090),
            (Some("kv-events"), 5557),
            (Some("kv-replay"), 5558)
        ]
    );
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
            "--ttft-slo",
            "1500ms",
            "--tpot-slo",
            "40ms",
            "--discover-namespace",
            "llm",
            "--prefill-selector",
            "app.kubernetes.io/name=kvpool,kvpool.dev/pool=roce,kvpool.dev/component=prefill",
            "--decode-selector",
            "app.kubernetes.io/name=kvpool,kvpool.dev/pool=roce,kvpool.dev/component=decode",
            "--engine-port",
            "8000",
            "--kv-events-port",
            "5557",
            "--hash-seed",
            "0",
            "--master",
            "roce-master.llm.svc:50051",
            "--auth-key-file",
            "/etc/kvpool/auth/key",
            "--block-size",
            "16",
            // No tokenizer files named: the engines' own /tokenize.
            "--tokenizer",
            "engine"
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
    // The RDMA allow-list and GID index reach the agent through this document.
    assert_eq!(effective.transport.devices, ["mlx5_0", "mlx5_1"]);
    let mut gid = roce();
    gid.spec.transport.gid_index = Some(3);
    let gid_children = build(&valid(&gid), "00ff").expect("build");
    let gid_yaml = &gid_children.config.data.as_ref().expect("data")["config.yaml"];
    let gid_effective: ValidatedKVCachePool = serde_saphyr::from_str(gid_yaml).expect("parses");
    assert_eq!(gid_effective.transport.gid_index, Some(3));
    assert!(gid_yaml.contains("gidIndex: 3"), "{gid_yaml}");

    let engine: serde_json::Value =
        serde_json::from_str(&data["engine.json"]).expect("engine.json parses");
    assert_eq!(engine["master_server_address"], "roce-master.llm.svc:50051");
    assert_eq!(engine["protocol"], "rdma");
    assert_eq!(engine["device_name"], "mlx5_0,mlx5_1");
    assert_eq!(engine["agent_socket"], "/run/kvpool/agent.sock");
    assert_eq!(engine["auth_key_file"], "/etc/kvpool/auth/key");
    assert_eq!(engine["block_size_tokens"], 256);
    assert_eq!(engine["pool"], "roce");
    assert_eq!(
        engine["replicas"],
        u64::from(pool.effective.replication.replicas)
    );

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
    use kvpool_proto::auth::{AuthKey, Role, RoleDocument};
    let pool = valid(&tcp());
    let key = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
    let a = build(&pool, key).expect("build");
    let b = build(&pool, key).expect("build");
    assert_eq!(a, b);
    let data = a.auth.data.as_ref().expect("data");
    assert_eq!(data["key"].0, key.as_bytes());
    assert_eq!(a.auth.metadata.name.as_deref(), Some("tcp-auth"));
    // One credential file per role, derived from the key, and nothing else.
    let pool_key = AuthKey::from_bytes(key.as_bytes()).expect("pool key");
    for role in [Role::Agent, Role::Engine, Role::Conductor, Role::Observer] {
        let doc = RoleDocument::parse(&data[role.name()].0).expect("role document");
        assert_eq!(doc.role, role);
        assert_eq!(
            doc.master,
            kvpool_proto::auth::role_key(key.as_bytes(), role)
        );
        assert_eq!(doc.transfer.is_some(), role.holds_transfer_key(), "{role}");
        assert!(pool_key.derive(role).is_some());
    }
    assert_eq!(data.len(), 5);
    // Marked as derived, so a person can tell it from a hand-made or legacy random key.
    let annotations = a.auth.metadata.annotations.as_ref().expect("annotations");
    assert_eq!(
        annotations
            .get("kvpool.dev/auth-derivation")
            .map(String::as_str),
        Some("v1")
    );
    // The master mounts the pool key, the conductor its own file, each as the one key path.
    let item = |d: &k8s_openapi::api::apps::v1::Deployment| {
        let spec = d.spec.as_ref().and_then(|s| s.template.spec.as_ref());
        let auth = spec
            .and_then(|p| p.volumes.as_ref())
            .and_then(|v| v.iter().find(|v| v.name == "auth"))
            .and_then(|v| v.secret.as_ref())
            .and_then(|s| s.items.clone())
            .expect("auth items");
        auth.iter()
            .map(|i| (i.key.clone(), i.path.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(item(&a.master), [("key".to_owned(), "key".to_owned())]);
    let roce = build(&valid(&roce()), key).expect("build");
    let (conductor, _) = roce.conductor.as_ref().expect("conductor");
    assert_eq!(
        item(conductor),
        [("conductor".to_owned(), "key".to_owned())]
    );
}

/// The conductor pod of `pool` as the operator renders it.
fn conductor_pod(pool: &kvpool_crd::KVCachePool) -> k8s_openapi::api::core::v1::PodSpec {
    let children = build(&valid(pool), "00ff").expect("build");
    let (deployment, _) = children.conductor.as_ref().expect("conductor");
    deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.clone())
        .expect("pod")
}

/// The pod's volume named `tokenizer`.
fn tokenizer_volume(
    spec: &k8s_openapi::api::core::v1::PodSpec,
) -> &k8s_openapi::api::core::v1::Volume {
    spec.volumes
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|v| v.name == "tokenizer")
        .expect("tokenizer volume")
}

#[test]
fn the_conductor_reads_the_model_tokenizer_from_the_volume_the_pool_names() {
    let mut pool = roce();
    pool.spec.conductor.engine_block_size = 32;
    pool.spec.conductor.tokenizer = Some(kvpool_crd::TokenizerSpec {
        persistent_volume_claim: Some("models".into()),
        sub_path: Some("Qwen/Qwen2.5-7B-Instruct".into()),
        ..Default::default()
    });
    let spec = conductor_pod(&pool);
    let c = &spec.containers[0];
    let args = c.args.as_deref().expect("args");
    assert!(has_arg(args, "--block-size", "32"));
    assert!(has_arg(
        args,
        "--tokenizer",
        "/etc/kvpool/tokenizer/Qwen/Qwen2.5-7B-Instruct"
    ));
    let mount = c
        .volume_mounts
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|m| m.name == "tokenizer")
        .expect("tokenizer mount");
    assert_eq!(mount.mount_path, "/etc/kvpool/tokenizer");
    assert_eq!(mount.read_only, Some(true));
    let claim = tokenizer_volume(&spec)
        .persistent_volume_claim
        .as_ref()
        .expect("claim");
    assert_eq!(claim.claim_name, "models");
    assert_eq!(claim.read_only, Some(true));
    // An image volume instead.
    pool.spec.conductor.tokenizer = Some(kvpool_crd::TokenizerSpec {
        image: Some("registry.example/qwen-tokenizer:1".into()),
        ..Default::default()
    });
    let spec = conductor_pod(&pool);
    assert_eq!(
        tokenizer_volume(&spec)
            .image
            .as_ref()
            .and_then(|i| i.reference.as_deref()),
        Some("registry.example/qwen-tokenizer:1")
    );
    let args = spec.containers[0].args.as_deref().expect("args");
    assert!(has_arg(args, "--tokenizer", "/etc/kvpool/tokenizer"));
}

#[test]
fn conductor_discovers_engines_with_its_own_least_privilege_identity() {
    let children = roce_children();
    let (deployment, _) = children.conductor.as_ref().expect("conductor");
    let spec = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec");
    assert_eq!(spec.service_account_name.as_deref(), Some("roce-conductor"));
    assert_eq!(spec.automount_service_account_token, Some(true));
    let args = spec.containers[0].args.as_ref().expect("args");
    assert_eq!(after(args, "--discover-namespace"), Some("llm"));
    assert_eq!(
        after(args, "--decode-selector"),
        Some("app.kubernetes.io/name=kvpool,kvpool.dev/pool=roce,kvpool.dev/component=decode")
    );
    assert_eq!(after(args, "--engine-port"), Some("8000"));

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

/// docs/images.md justifies every capability the operator adds to a pod, and lists no other:
/// its table has one `| pod | `CAP` | why |` row per capability of the agent and the engines.
#[test]
fn every_added_capability_is_justified_in_docs_images_md() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/images.md");
    let doc = std::fs::read_to_string(&path).expect("docs/images.md");
    let mut documented = std::collections::BTreeSet::new();
    for line in doc.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if let [_, pod @ ("agent" | "engine"), cap, why, _] = cells[..]
            && let Some(cap) = cap.strip_prefix('`').and_then(|c| c.strip_suffix('`'))
            && cap.bytes().all(|b| b.is_ascii_uppercase() || b == b'_')
        {
            assert!(why.len() > 40, "{pod} {cap}: say why");
            documented.insert((pod.to_owned(), cap.to_owned()));
        }
    }
    let added: std::collections::BTreeSet<(String, String)> = AGENT_CAPABILITIES
        .iter()
        .map(|c| ("agent".to_owned(), (*c).to_owned()))
        .chain(
            crate::enginepool::build::ENGINE_CAPABILITIES
                .iter()
                .map(|c| ("engine".to_owned(), (*c).to_owned())),
        )
        .collect();
    assert_eq!(
        documented, added,
        "docs/images.md capability table vs the builders"
    );
    // And the builders really add exactly those.
    let agent = build(&valid(&roce()), "00").expect("build").agent;
    let caps = pod(&agent).containers[0]
        .security_context
        .as_ref()
        .and_then(|s| s.capabilities.clone())
        .expect("capabilities");
    assert_eq!(caps.add.unwrap_or_default(), AGENT_CAPABILITIES);
}

#[test]
fn a_persistent_dram_tier_mounts_its_host_directories() {
    let mut spec = tcp();
    spec.spec.dram.persistence = Some(kvpool_crd::DramPersistenceSpec {
        mode: kvpool_crd::PersistenceMode::Tmpfs,
        host_path: Some("/dev/shm/kvpool".into()),
        index_host_path: None,
    });
    let pool = valid(&spec);
    let children = build(&pool, "00ff").expect("build");
    let pod = pod(&children.agent);
    let volumes = pod.volumes.as_ref().expect("volumes");
    let tier = host_path(volumes, "dram-tier");
    assert_eq!(tier.path, "/dev/shm/kvpool");
    assert_eq!(tier.type_.as_deref(), Some("DirectoryOrCreate"));
    assert!(
        !volumes.iter().any(|v| v.name == "dram-index"),
        "the index shares the tier's directory"
    );
    let c = &pod.containers[0];
    assert!(
        c.volume_mounts
            .as_ref()
            .expect("mounts")
            .iter()
            .any(|m| m.name == "dram-tier"
                && m.mount_path == "/dev/shm/kvpool"
                && m.read_only != Some(true))
    );
    // The agent's document carries it.
    assert_eq!(
        pool.effective
            .dram
            .persistence
            .as_ref()
            .map(|p| p.host_path.as_str()),
        Some("/dev/shm/kvpool")
    );
    // Without it, no such volume.
    let plain = build(&valid(&tcp()), "00ff").expect("build");
    assert!(
        !self::pod(&plain.agent)
            .volumes
            .as_ref()
            .expect("volumes")
            .iter()
            .any(|v| v.name.starts_with("dram-"))
    );
}

#[test]
fn master_tls_reaches_the_master_and_every_client_of_it() {
    let mut spec = roce();
    spec.spec.master.tls = Some(kvpool_crd::MasterTlsSpec {
        secret_name: "roce-master-tls".into(),
        client_secret_name: Some("roce-client-tls".into()),
        server_name: None,
    });
    let children = build(&valid(&spec), "00ff").expect("build");
    let template = |d: &k8s_openapi::api::apps::v1::Deployment| {
        d.spec
            .as_ref()
            .and_then(|s| s.template.spec.clone())
            .expect("pod")
    };
    let master = template(&children.master);
    let args = master.containers[0].args.clone().expect("args");
    for flag in ["--tls-cert-file", "--tls-key-file", "--tls-client-ca-file"] {
        assert!(args.iter().any(|a| a == flag), "{flag}: {args:?}");
    }
    let env_of = |p: &PodSpec| -> Vec<String> {
        p.containers[0]
            .env
            .iter()
            .flatten()
            .map(|e| e.name.clone())
            .collect()
    };
    let (conductor, _) = children.conductor.as_ref().expect("conductor");
    for (what, p) in [
        ("agent", pod(&children.agent).clone()),
        ("conductor", template(conductor)),
    ] {
        let env = env_of(&p);
        for name in [
            "KVPOOL_MASTER_CA_FILE",
            "KVPOOL_MASTER_CLIENT_CERT_FILE",
            "KVPOOL_MASTER_CLIENT_KEY_FILE",
        ] {
            assert!(
                env.iter().any(|e| e == name),
                "{what} lacks {name}: {env:?}"
            );
        }
        // The clients see the master's CA, never its key.
        let server = p
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == "master-tls")
            .and_then(|v| v.secret.as_ref())
            .and_then(|s| s.items.clone())
            .expect("master-tls volume");
        assert_eq!(server.len(), 1, "{what}");
        assert_eq!(server[0].key, "ca.crt");
    }
    // Without spec.master.tls nothing of it appears.
    let plain = roce_children();
    let master = template(&plain.master);
    assert!(
        master.containers[0]
            .args
            .iter()
            .flatten()
            .all(|a| !a.starts_with("--tls"))
    );
    assert!(
        env_of(pod(&plain.agent))
            .iter()
            .all(|e| !e.starts_with("KVPOOL_MASTER_"))
    );
}

#[test]
fn transfer_tls_reaches_the_agents_and_their_pool_document() {
    let mut spec = roce();
    spec.spec.transport.tls = Some(kvpool_crd::TransferTlsSpec {
        mode: kvpool_crd::TransferTlsMode::Require,
        secret_name: "roce-transfer-tls".into(),
        server_name: Some("agents.kvpool.example".into()),
    });
    let children = build(&valid(&spec), "00ff").expect("build");
    let agent = pod(&children.agent);
    let volume = agent
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "transfer-tls")
        .and_then(|v| v.secret.as_ref())
        .expect("transfer-tls volume");
    assert_eq!(volume.secret_name.as_deref(), Some("roce-transfer-tls"));
    let items: Vec<&str> = volume
        .items
        .iter()
        .flatten()
        .map(|i| i.key.as_str())
        .collect();
    assert_eq!(items, ["tls.crt", "tls.key", "ca.crt"]);
    assert!(
        agent.containers[0]
            .volume_mounts
            .iter()
            .flatten()
            .any(|m| m.name == "transfer-tls" && m.mount_path == kvpool_crd::TRANSFER_TLS_DIR)
    );
    // The setting reaches the agents through the pool document.
    let doc = children
        .config
        .data
        .as_ref()
        .and_then(|d| d.values().find(|v| v.contains("secretName")))
        .expect("pool document with the TLS setting");
    assert!(
        doc.contains("roce-transfer-tls") && doc.contains("agents.kvpool.example"),
        "{doc}"
    );
    // Without it nothing appears.
    let plain = roce_children();
    assert!(
        pod(&plain.agent)
            .volumes
            .iter()
            .flatten()
            .all(|v| v.name != "transfer-tls")
    );
}

#[test]
fn with_the_agent_issuer_agents_carry_a_projected_token_and_no_shared_credential() {
    let ca = crate::issuer::IssuerCa::derive(&crate::root_key::RootKey::for_tests()).expect("CA");
    let mut pool = valid(&tcp());
    pool.agent_issuer = Some(crate::issuer::AgentIssuer {
        url: "https://kvpool-operator-agent-issuer.kvpool-system.svc:8443".to_owned(),
        ca_pem: ca.ca_pem(),
    });
    let children = build(&pool, "00ff").expect("build");
    let spec = pod(&children.agent);
    let volumes = spec.volumes.as_ref().expect("volumes");
    assert!(
        volumes.iter().all(|v| v.secret.is_none()),
        "no Secret in an agent pod: {volumes:?}"
    );
    let token = volumes
        .iter()
        .find(|v| v.name == "agent-token")
        .and_then(|v| v.projected.as_ref())
        .and_then(|p| p.sources.as_ref())
        .and_then(|s| s[0].service_account_token.as_ref())
        .expect("projected token");
    assert_eq!(
        token.audience.as_deref(),
        Some(kvpool_proto::issuer::AUDIENCE)
    );
    assert_eq!(
        token.expiration_seconds,
        Some(crate::contract::AGENT_TOKEN_SECONDS)
    );
    let mounts = spec.containers[0].volume_mounts.as_ref().expect("mounts");
    assert!(mounts.iter().any(|m| m.name == "agent-token"
        && m.mount_path == crate::contract::AGENT_TOKEN_DIR
        && m.read_only == Some(true)));
    assert!(!mounts.iter().any(|m| m.name == "auth"));
    // The pool document tells the agent where to ask and whom to trust.
    let doc: serde_json::Value = serde_saphyr::from_str(
        &children.config.data.as_ref().expect("data")[crate::contract::CONFIG_FILE_KEY],
    )
    .expect("yaml");
    assert_eq!(
        doc["credentialIssuer"]["url"],
        "https://kvpool-operator-agent-issuer.kvpool-system.svc:8443"
    );
    assert_eq!(doc["credentialIssuer"]["caPem"], ca.ca_pem());
    assert_eq!(
        doc["credentialIssuer"]["tokenFile"],
        format!(
            "{}/{}",
            crate::contract::AGENT_TOKEN_DIR,
            crate::contract::AGENT_TOKEN_FILE
        )
    );
    // The master binds agents to their nodes; without the issuer it lets them share.
    let master_args = |c: &CachePoolChildren| {
        c.master
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .expect("pod")
            .containers[0]
            .args
            .clone()
            .expect("args")
    };
    assert!(
        !master_args(&children)
            .iter()
            .any(|a| a == "--shared-agent-credentials")
    );
    let shared = build(&valid(&tcp()), "00ff").expect("build");
    assert!(
        master_args(&shared)
            .iter()
            .any(|a| a == "--shared-agent-credentials")
    );
    let shared_doc = &shared.config.data.as_ref().expect("data")[crate::contract::CONFIG_FILE_KEY];
    assert!(!shared_doc.contains("credentialIssuer"));
}
