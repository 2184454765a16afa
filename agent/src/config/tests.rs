//! Unit tests of the configuration: full files, the pool section, the operator's pool
//! document, and bad values naming their field.

use super::*;

#[cfg(feature = "kube")]
const POOL_DOC: &str = "pool: p\nnamespace: ns\nmasterAddr: p-master.ns.svc:50051\n\
authKeyFile: /etc/kvpool/auth/key\nagentSocket: /run/kvpool/agent.sock\nblockSizeTokens: 256\n\
dram: {capacity: {nodeMemoryPercent: 50}, hugepages: 2Mi, numaPolicy: interleave}\n\
ssd: {hostPath: /mnt/nvme, capacityBytes: 1073741824}\n\
transport: {protocol: tcp, devices: [], sriov: null, networks: [], port: 15600}\n\
replication: {replicas: 2, spreadLabelKey: kubernetes.io/hostname}\n\
eviction: {highWatermarkPercent: 90, lowWatermarkPercent: 80, policy: lru}\n\
master: {replicas: 1, etcdEndpoints: []}\nconductor: null\n";

#[test]
// A pool document publishes the topology: the Kubernetes API (`kube`).
#[cfg(feature = "kube")]
fn pool_document_maps_to_the_agent_config() {
    let doc = parse_pool_document(POOL_DOC, Path::new("c.yaml")).expect("parses");
    let mut file = from_pool_document(&doc, 64 << 30).expect("maps");
    assert_eq!(file.dram.capacity, Some(ByteSize::gib(32)));
    assert_eq!(file.dram.hugepages.as_deref(), Some("2MiB"));
    assert_eq!(file.dram.numa_policy, Some(NumaPolicy::Interleave));
    let unbound = POOL_DOC.replace("numaPolicy: interleave", "numaPolicy: none");
    let doc = parse_pool_document(&unbound, Path::new("c.yaml")).expect("parses");
    let none = from_pool_document(&doc, 64 << 30).expect("maps");
    assert_eq!(none.dram.numa_policy, Some(NumaPolicy::None));
    assert_eq!(file.ssd.path, Some(PathBuf::from("/mnt/nvme")));
    assert_eq!(file.pool.master, ["p-master.ns.svc:50051"]);
    assert_eq!(file.pool.transport_listen.as_deref(), Some("0.0.0.0:15600"));
    assert_eq!(
        file.pool.replicas,
        Some(2),
        "engine puts get the pool's replica count"
    );
    file.pool.advertise_host = Some("10.0.0.1".into());
    file.node_name = Some("n".into());
    let cfg = validate(&file).expect("validates");
    assert_eq!(cfg.dram.hugepage_size, Some(2 << 20));
    assert_eq!(cfg.api.socket_dir, PathBuf::from("/run/kvpool"));
    assert_eq!(
        cfg.api.client_group,
        Some(kvpool_crd::POOL_CLIENT_GROUP),
        "engines in the operator's fsGroup may use the socket"
    );
    assert_eq!(
        cfg.kubernetes,
        KubernetesConfig {
            failure_domain_label: Some("kubernetes.io/hostname".into()),
            publish_topology: true,
        },
        "the spread label names the failure domain; the node gets the topology labels"
    );
    let pool = cfg.pool.expect("pool mode");
    assert_eq!(
        pool.failure_domain, None,
        "read from the node, not the document"
    );
    assert_eq!(pool.transport_listen.port(), 15600);
    assert_eq!(file.pool.transport.as_deref(), Some("tcp"));
    assert!(!pool.want_rdma, "the document's transport is tcp");
    let rdma = POOL_DOC.replace("protocol: tcp", "protocol: rdma");
    let doc = parse_pool_document(&rdma, Path::new("c.yaml")).expect("parses");
    let file = from_pool_document(&doc, 64 << 30).expect("maps");
    assert_eq!(file.pool.transport.as_deref(), Some("rdma"));

    let bad = POOL_DOC.replace("/run/kvpool/agent.sock", "/run/kvpool/other.sock");
    let doc = parse_pool_document(&bad, Path::new("c.yaml")).expect("parses");
    let err = from_pool_document(&doc, 64 << 30).expect_err("wrong socket name");
    assert_eq!(field_of(err), "agentSocket");
    let err = parse_pool_document("pool: p\n", Path::new("c.yaml")).expect_err("missing");
    assert_eq!(err.category(), "parse");
}

#[test]
// A pool document publishes the topology: the Kubernetes API (`kube`).
#[cfg(feature = "kube")]
fn the_pools_transfer_integrity_reaches_the_agents_lanes() {
    let doc = parse_pool_document(POOL_DOC, Path::new("c.yaml")).expect("parses");
    let file = from_pool_document(&doc, 64 << 30).expect("maps");
    assert_eq!(
        file.pool.transport_integrity.as_deref(),
        Some("allow"),
        "the default"
    );
    let required = POOL_DOC.replace(
        "protocol: tcp, devices: []",
        "protocol: tcp, devices: [], integrity: require",
    );
    let doc = parse_pool_document(&required, Path::new("c.yaml")).expect("parses");
    let mut file = from_pool_document(&doc, 64 << 30).expect("maps");
    file.pool.advertise_host = Some("10.0.0.1".into());
    file.node_name = Some("n".into());
    let pool = validate(&file).expect("validates").pool.expect("pool mode");
    assert_eq!(pool.integrity, kvpool_transfer::Integrity::Require);
}

#[test]
// A pool document publishes the topology: the Kubernetes API (`kube`).
#[cfg(feature = "kube")]
fn the_pools_transfer_tls_reaches_the_agents_lanes_with_the_mounted_files() {
    let doc = parse_pool_document(POOL_DOC, Path::new("c.yaml")).expect("parses");
    let file = from_pool_document(&doc, 64 << 30).expect("maps");
    assert_eq!(file.pool.transport_tls, None, "off unless the pool asks");
    let with_tls = POOL_DOC.replace(
        "protocol: tcp, devices: []",
        "protocol: tcp, devices: [], tls: {secretName: agents-tls}",
    );
    let doc = parse_pool_document(&with_tls, Path::new("c.yaml")).expect("parses");
    let mut file = from_pool_document(&doc, 64 << 30).expect("maps");
    file.pool.advertise_host = Some("10.0.0.1".into());
    file.node_name = Some("n".into());
    let pool = validate(&file).expect("validates").pool.expect("pool mode");
    let dir = Path::new(kvpool_crd::TRANSFER_TLS_DIR);
    assert_eq!(pool.tls.mode, kvpool_transfer::TlsMode::Require);
    assert_eq!(
        pool.tls.cert_file.as_deref(),
        Some(dir.join("tls.crt").as_path())
    );
    assert_eq!(
        pool.tls.key_file.as_deref(),
        Some(dir.join("tls.key").as_path())
    );
    assert_eq!(
        pool.tls.ca_file.as_deref(),
        Some(dir.join("ca.crt").as_path())
    );
    let name = format!("{}-transfer.{}.svc", doc.pool, doc.namespace);
    assert_eq!(pool.tls.server_name.as_deref(), Some(name.as_str()));
    let allow = with_tls.replace(
        "{secretName: agents-tls}",
        "{secretName: a, mode: allow, serverName: x.example}",
    );
    let doc = parse_pool_document(&allow, Path::new("c.yaml")).expect("parses");
    let file = from_pool_document(&doc, 64 << 30).expect("maps");
    assert_eq!(file.pool.transport_tls.as_deref(), Some("allow"));
    assert_eq!(
        file.pool.transport_tls_server_name.as_deref(),
        Some("x.example")
    );
}

#[test]
// A pool document publishes the topology: the Kubernetes API (`kube`).
#[cfg(feature = "kube")]
fn the_pools_rdma_allow_list_and_gid_index_reach_the_transfer_engine() {
    let rdma = POOL_DOC.replace(
        "protocol: tcp, devices: []",
        "protocol: rdma, gidIndex: 5, devices: [mlx5_0, mlx5_3]",
    );
    let doc = parse_pool_document(&rdma, Path::new("c.yaml")).expect("parses");
    let mut file = from_pool_document(&doc, 64 << 30).expect("maps");
    assert_eq!(file.pool.rdma_devices, ["mlx5_0", "mlx5_3"]);
    assert_eq!(file.pool.gid_index, Some(5));
    file.pool.advertise_host = Some("10.0.0.1".into());
    file.node_name = Some("n".into());
    let pool = validate(&file).expect("validates").pool.expect("pool mode");
    let engine = crate::pool::engine_config(&pool, "n");
    assert!(engine.want_rdma);
    assert_eq!(engine.rdma_nics.allow, ["mlx5_0", "mlx5_3"]);
    assert_eq!(engine.rdma_nics.gid_index, Some(5));
    // The operator's own document for its RoCE example (golden copy of its build output).
    let golden = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/operator/operator_tests_fixtures_kvcachepool-roce.yaml");
    let text = std::fs::read_to_string(&golden).expect("golden document");
    let doc = parse_pool_document(&text, &golden).expect("parses");
    let file = from_pool_document(&doc, 64 << 30).expect("maps");
    assert_eq!(file.pool.rdma_devices, ["mlx5_0", "mlx5_1"]);
    // Without them the engine may use every device, with the automatic GID.
    let doc = parse_pool_document(POOL_DOC, Path::new("c.yaml")).expect("parses");
    let file = from_pool_document(&doc, 64 << 30).expect("maps");
    assert!(file.pool.rdma_devices.is_empty() && file.pool.gid_index.is_none());
    for (yaml, field) in [
        (
            "pool: {master: [m:1], auth_key_file: /k, transport_listen: 127.0.0.1:0, transport: rdma, gid_index: 300}",
            "pool.gid_index",
        ),
        (
            "pool: {master: [m:1], auth_key_file: /k, transport_listen: 127.0.0.1:0, transport: rdma, rdma_devices: [' ']}",
            "pool.rdma_devices",
        ),
        (
            "pool: {master: [m:1], auth_key_file: /k, transport_listen: 127.0.0.1:0, transport: tcp, rdma_devices: [mlx5_0]}",
            "pool.transport",
        ),
    ] {
        let err = validate_yaml(yaml).expect_err(yaml);
        assert_eq!(field_of(err), field, "{yaml}");
    }
}

#[test]
fn transport_integrity_reaches_the_transfer_engine_and_bad_values_are_named() {
    let base = "pool: {master: [m:1], auth_key_file: /k, transport_listen: 127.0.0.1:0";
    for (value, want) in [
        ("", kvpool_transfer::Integrity::Allow),
        (
            ", transport_integrity: require",
            kvpool_transfer::Integrity::Require,
        ),
        (
            ", transport_integrity: \"off\"",
            kvpool_transfer::Integrity::Off,
        ),
    ] {
        let yaml = format!("{base}{value}}}");
        let pool = validate_yaml(&yaml)
            .expect("validates")
            .pool
            .expect("pool mode");
        assert_eq!(
            crate::pool::engine_config(&pool, "n").integrity,
            want,
            "{yaml}"
        );
    }
    let err = validate_yaml(&format!("{base}, transport_integrity: always}}")).expect_err("bad");
    assert_eq!(field_of(err), "pool.transport_integrity");
}

fn validate_yaml(text: &str) -> Result<AgentConfig, ConfigError> {
    validate(&parse(text, Path::new("test.yaml"))?)
}

fn field_of(err: ConfigError) -> &'static str {
    match err {
        ConfigError::Invalid { field, .. } => field,
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[test]
fn full_config_parses_with_typed_sizes() {
    let cfg = validate_yaml(
        r"
node_name: gpu-node-7
discovery:
  sysfs_root: /host/sys
dram:
  capacity: 64GiB
  numa_policy:
    nodes: [0, 1]
  hugepages: 2MiB
  lock: false
ssd:
  path: /var/lib/kvpool/ssd
  capacity: 1.5 TiB
  direct_io: off
  persist_dram_on_shutdown: true
  sync_interval: 250ms
engine_api:
  socket_dir: /run/kvpool
  max_staging_bytes: 256MiB
admin:
  listen: 127.0.0.1:9000
",
    )
    .expect("valid");
    assert_eq!(cfg.node_name, "gpu-node-7");
    assert_eq!(cfg.roots.sysfs, PathBuf::from("/host/sys"));
    assert_eq!(cfg.roots.procfs, PathBuf::from("/proc"));
    assert_eq!(cfg.dram.capacity, 64 << 30);
    assert_eq!(cfg.dram.policy, NumaPolicy::Nodes(vec![0, 1]));
    assert_eq!(cfg.dram.hugepage_size, Some(2 << 20));
    assert!(!cfg.dram.lock);
    let ssd = cfg.ssd.expect("ssd");
    assert_eq!(ssd.tier.capacity, 1_649_267_441_664);
    assert_eq!(ssd.tier.direct_io, DirectIo::Off);
    assert_eq!(ssd.sync_interval, Duration::from_millis(250));
    assert_eq!(cfg.api.shm_dir, PathBuf::from("/run/kvpool"));
    assert_eq!(cfg.api.limits.max_staging_bytes, 256 << 20);
    assert_eq!(cfg.admin_listen.port(), 9000);
}

#[test]
fn pool_section_is_optional_and_validated() {
    assert!(
        validate_yaml("").expect("valid").pool.is_none(),
        "local-only by default"
    );
    let cfg = validate_yaml(
        "pool:\n  master: [10.0.0.1:50051]\n  auth_key_file: /etc/kvpool/key\n  transport_listen: 0.0.0.0:7000\n  advertise_host: 10.0.0.9\n  heartbeat_interval: 500ms\n",
    )
    .expect("valid");
    let pool = cfg.pool.expect("pool mode");
    assert_eq!(pool.masters, vec!["10.0.0.1:50051".to_owned()]);
    assert_eq!(pool.transport_listen.port(), 7000);
    assert_eq!(pool.advertise_host.to_string(), "10.0.0.9");
    assert_eq!(pool.heartbeat_interval, Duration::from_millis(500));
    // A concrete listen address is announced as is.
    let pool =
        validate_yaml("pool: {master: [m:1], auth_key_file: /k, transport_listen: 127.0.0.1:0}")
            .expect("valid")
            .pool
            .expect("pool mode");
    assert_eq!(pool.advertise_host.to_string(), "127.0.0.1");
    assert_eq!(pool.heartbeat_interval, Duration::from_secs(1));
    assert_eq!(
        (pool.replicas, pool.max_tasks, pool.task_timeout),
        (1, 4, Duration::from_secs(30)),
        "defaults"
    );
    let pool = validate_yaml(
        "pool: {master: [m:1], auth_key_file: /k, transport_listen: 127.0.0.1:0, replicas: 2, max_tasks: 16, task_timeout: 2s}",
    )
    .expect("valid")
    .pool
    .expect("pool mode");
    assert_eq!(
        (pool.replicas, pool.max_tasks, pool.task_timeout),
        (2, 16, Duration::from_secs(2))
    );
    assert!(!pool.want_rdma, "TCP unless the pool asks for RDMA");
    for (transport, want, require) in [
        ("rdma", true, true),
        ("auto", true, false),
        ("tcp", false, false),
    ] {
        let pool = validate_yaml(&format!(
            "pool: {{master: [m:1], auth_key_file: /k, transport_listen: 127.0.0.1:0, transport: {transport}}}"
        ))
        .expect("valid")
        .pool
        .expect("pool mode");
        assert_eq!(pool.want_rdma, want, "{transport}");
        assert_eq!(pool.require_rdma, require, "{transport}");
    }
    let cases = [
        (
            "pool: {master: [m:1], auth_key_file: /k, advertise_host: 10.0.0.1, transport: infiniband}",
            "pool.transport",
        ),
        (
            "pool: {master: [m:1], auth_key_file: /k, advertise_host: 10.0.0.1, replicas: 0}",
            "pool.replicas",
        ),
        (
            "pool: {master: [m:1], auth_key_file: /k, advertise_host: 10.0.0.1, failure_domain: 'rack 1'}",
            "pool.failure_domain",
        ),
        (
            "kubernetes: {failure_domain_label: 'Not A/Key'}",
            "kubernetes.failure_domain_label",
        ),
        (
            "pool: {master: [m:1], auth_key_file: /k, advertise_host: 10.0.0.1, max_tasks: 0}",
            "pool.max_tasks",
        ),
        (
            "pool: {master: [m:1], auth_key_file: /k, advertise_host: 10.0.0.1, task_timeout: never}",
            "pool.task_timeout",
        ),
        ("pool: {master: [m:1]}", "pool.auth_key_file"),
        ("pool: {master: [''], auth_key_file: /k}", "pool.master"),
        (
            "pool: {master: [m:1], auth_key_file: /k, transport_listen: x}",
            "pool.transport_listen",
        ),
        (
            "pool: {master: [m:1], auth_key_file: /k, transport_listen: 0.0.0.0:1}",
            "pool.advertise_host",
        ),
        (
            "pool: {master: [m:1], auth_key_file: /k, advertise_host: node-7}",
            "pool.advertise_host",
        ),
        (
            "pool: {master: [m:1], auth_key_file: /k, advertise_host: 10.0.0.1, heartbeat_interval: 1ms}",
            "pool.heartbeat_interval",
        ),
    ];
    for (text, field) in cases {
        let err = validate_yaml(text).expect_err(text);
        assert_eq!(field_of(err), field, "{text}");
    }
}

#[test]
fn bad_values_name_their_field() {
    let cases = [
        ("dram: {capacity: 1KiB}", "dram.capacity"),
        ("dram: {hugepages: 4MiB}", "dram.hugepages"),
        ("dram: {hugepages: lots}", "dram.hugepages"),
        ("ssd: {path: /x}", "ssd.capacity"),
        ("ssd: {capacity: 1GiB}", "ssd.path"),
        ("ssd: {path: rel, capacity: 1GiB}", "ssd.path"),
        (
            "ssd: {path: /x, capacity: 1GiB, sync_interval: soon}",
            "ssd.sync_interval",
        ),
        ("engine_api: {max_sessions: 0}", "engine_api.max_sessions"),
        (
            "engine_api: {socket_dir: relative}",
            "engine_api.socket_dir",
        ),
        ("admin: {listen: 'nonsense'}", "admin.listen"),
        (
            "engine_api: {session_idle_timeout: 10ms}",
            "engine_api.session_idle_timeout",
        ),
        ("node_name: ''", "node_name"),
        ("dram: {numa_policy: {nodes: []}}", "dram.numa_policy"),
    ];
    for (yaml, field) in cases {
        let err = validate_yaml(yaml).expect_err(yaml);
        assert_eq!(field_of(err), field, "{yaml}");
    }
}

#[test]
fn numa_policy_none_means_unbound() {
    for (text, want) in [
        ("dram: {numa_policy: none}", NumaPolicy::None),
        ("dram: {numa_policy: interleave}", NumaPolicy::Interleave),
        ("dram: {numa_policy: nic-local}", NumaPolicy::NicLocal),
        ("", NumaPolicy::NicLocal),
    ] {
        assert_eq!(validate_yaml(text).expect(text).dram.policy, want, "{text}");
    }
    let err = validate_yaml("dram: {numa_policy: nowhere}").expect_err("unknown policy");
    assert_eq!(err.category(), "parse");
    assert!(err.to_string().contains("nowhere"), "{err}");
}

#[test]
fn unknown_fields_and_bad_types_are_parse_errors() {
    let err = validate_yaml("dram: {capacty: 1GiB}").expect_err("typo");
    assert_eq!(err.category(), "parse");
    assert!(err.to_string().contains("capacty"), "{err}");
    let err = validate_yaml("dram: {capacity: [1]}").expect_err("type");
    assert_eq!(err.category(), "parse");
}

#[test]
fn empty_file_gives_defaults() {
    let cfg = validate_yaml("").expect("defaults");
    assert_eq!(cfg.dram.capacity, 1 << 30);
    assert!(cfg.ssd.is_none());
    assert_eq!(cfg.api.socket_dir, PathBuf::from("/run/kvpool"));
}

#[test]
fn limits_are_spelled_out_in_the_reason() {
    let pool = "pool: {master: [m:1], auth_key_file: /k, advertise_host: 10.0.0.1";
    let cases = [
        (
            "engine_api: {session_idle_timeout: 10ms}".to_owned(),
            "must be at least 1s",
        ),
        (
            format!("{pool}, heartbeat_interval: 1ms}}"),
            "must be at least 10ms",
        ),
        (
            format!("{pool}, task_timeout: 5ms}}"),
            "must be at least 100ms",
        ),
        (format!("{pool}, replicas: 9}}"), "must be between 1 and 8"),
        (
            format!("{pool}, max_tasks: 300}}"),
            "must be between 1 and 256",
        ),
    ];
    for (yaml, want) in cases {
        match validate_yaml(&yaml).expect_err(&yaml) {
            ConfigError::Invalid { reason, .. } => assert_eq!(reason, want, "{yaml}"),
            other => panic!("expected Invalid, got {other:?}"),
        }
    }
}

#[test]
fn failure_domain_and_kubernetes_settings_validate() {
    let cfg = validate(
        &parse(
            "pool: {master: [m:1], auth_key_file: /k, advertise_host: 10.0.0.1, failure_domain: rack-1}\n\
             kubernetes: {failure_domain_label: topology.kubernetes.io/zone}",
            Path::new("c.yaml"),
        )
        .expect("parses"),
    )
    .expect("valid");
    assert_eq!(
        cfg.pool.expect("pool").failure_domain.as_deref(),
        Some("rack-1")
    );
    assert!(cfg.kubernetes.uses_api());
    assert!(!cfg.kubernetes.publish_topology);
    let plain = validate(&FileConfig::default()).expect("defaults");
    assert!(!plain.kubernetes.uses_api(), "no API server unless asked");
}

#[test]
fn dram_persistence_is_validated_naming_its_fields() {
    const POOL: &str = "pool:\n  master: [\"127.0.0.1:1\"]\n  auth_key_file: /k\n  \
                        advertise_host: 10.0.0.1\n";
    let ok = validate_yaml(&format!(
        "node_name: n\ndram:\n  persistence:\n    mode: tmpfs\n    path: /dev/shm/kvpool\n{POOL}"
    ))
    .expect("valid");
    assert_eq!(
        ok.dram.persistence,
        Some(DramPersistence {
            mode: PersistenceMode::Tmpfs,
            dir: PathBuf::from("/dev/shm/kvpool"),
            index_dir: PathBuf::from("/dev/shm/kvpool"),
        })
    );
    let huge = validate_yaml(&format!(
        "node_name: n\ndram:\n  persistence:\n    mode: hugetlbfs\n    path: /mnt/huge\n    \
         index_path: /dev/shm/kvpool-index\n{POOL}"
    ))
    .expect("valid");
    let p = huge.dram.persistence.expect("persistent");
    assert_eq!(p.mode, PersistenceMode::Hugetlbfs);
    assert_eq!(p.index_dir, PathBuf::from("/dev/shm/kvpool-index"));
    let none = validate_yaml(&format!(
        "node_name: n\ndram:\n  persistence: {{mode: none}}\n{POOL}"
    ))
    .expect("valid");
    assert_eq!(none.dram.persistence, None);
    let cases = [
        (
            format!("dram:\n  persistence: {{mode: tmpfs}}\n{POOL}"),
            "dram.persistence.path",
        ),
        (
            format!("dram:\n  persistence: {{mode: tmpfs, path: rel/dir}}\n{POOL}"),
            "dram.persistence.path",
        ),
        (
            format!("dram:\n  persistence: {{mode: hugetlbfs, path: /mnt/huge}}\n{POOL}"),
            "dram.persistence.index_path",
        ),
        // Local-only mode has no use for it.
        (
            "dram:\n  persistence: {mode: tmpfs, path: /dev/shm/x}\n".to_owned(),
            "dram.persistence",
        ),
    ];
    for (yaml, field) in cases {
        let err = validate_yaml(&yaml).expect_err(&yaml);
        assert_eq!(field_of(err), field, "{yaml}");
    }
    assert!(validate_yaml("dram:\n  persistence: {mode: disk, path: /x}\n").is_err());
}

#[test]
// A pool document publishes the topology: the Kubernetes API (`kube`).
#[cfg(feature = "kube")]
fn pool_document_persistence_maps_to_the_dram_tier() {
    let doc = POOL_DOC.replace(
        "numaPolicy: interleave}",
        "numaPolicy: interleave, persistence: {mode: tmpfs, hostPath: /dev/shm/kvpool, \
         indexHostPath: /dev/shm/kvpool}}",
    );
    let doc = parse_pool_document(&doc, Path::new("c.yaml")).expect("parses");
    let mut file = from_pool_document(&doc, 64 << 30).expect("maps");
    file.pool.advertise_host = Some("10.0.0.1".into());
    file.node_name = Some("n".into());
    let cfg = validate(&file).expect("validates");
    assert_eq!(
        cfg.dram.persistence,
        Some(DramPersistence {
            mode: PersistenceMode::Tmpfs,
            dir: PathBuf::from("/dev/shm/kvpool"),
            index_dir: PathBuf::from("/dev/shm/kvpool"),
        })
    );
}

#[test]
fn transport_tls_reaches_the_transfer_engine_and_missing_files_are_named() {
    let base = "pool: {master: [m:1], auth_key_file: /k, transport_listen: 127.0.0.1:0";
    let pool = validate_yaml(&format!("{base}}}"))
        .expect("validates")
        .pool
        .expect("pool mode");
    assert_eq!(
        crate::pool::engine_config(&pool, "n").tls.mode,
        kvpool_transfer::TlsMode::Off
    );
    let yaml = format!(
        "{base}, transport_tls: require, transport_tls_cert_file: /c.pem, \
         transport_tls_key_file: /k.pem, transport_tls_ca_file: /ca.pem, \
         transport_tls_server_name: agents.kvpool}}"
    );
    let pool = validate_yaml(&yaml)
        .expect("validates")
        .pool
        .expect("pool mode");
    let tls = crate::pool::engine_config(&pool, "n").tls;
    assert_eq!(tls.mode, kvpool_transfer::TlsMode::Require);
    assert_eq!(tls.ca_file.as_deref(), Some(Path::new("/ca.pem")));
    assert_eq!(tls.server_name.as_deref(), Some("agents.kvpool"));
    for (yaml, field) in [
        (
            format!("{base}, transport_tls: always}}"),
            "pool.transport_tls",
        ),
        (
            format!("{base}, transport_tls: allow}}"),
            "pool.transport_tls_cert_file",
        ),
        (
            format!(
                "{base}, transport_tls: require, transport_tls_cert_file: /c, \
                 transport_tls_key_file: /k}}"
            ),
            "pool.transport_tls_ca_file",
        ),
    ] {
        let err = validate_yaml(&yaml).expect_err("bad");
        assert_eq!(field_of(err), field, "{yaml}");
    }
}

#[test]
#[cfg(not(feature = "kube"))]
fn without_kube_a_pool_document_is_refused_naming_the_feature() {
    let mut file = FileConfig::default();
    file.kubernetes.publish_topology = Some(true);
    let err = validate(&file)
        .expect_err("needs the API server")
        .to_string();
    assert!(err.contains("kubernetes.publish_topology"), "{err}");
    assert!(err.contains("rebuild with --features k8s"), "{err}");
    // The hostname label needs no API call.
    let mut file = FileConfig::default();
    file.kubernetes.failure_domain_label = Some(crate::node::HOSTNAME_LABEL.into());
    validate(&file).expect("no API server needed");
}

#[test]
fn same_node_shm_shares_on_the_socket_dir_unless_off_or_tls_is_required() {
    let base = "engine_api: {socket_dir: /run/kv}\n\
                pool: {master: [m:1], auth_key_file: /k, transport_listen: 127.0.0.1:0";
    let shm = |extra: &str| {
        validate_yaml(&format!("{base}{extra}}}"))
            .expect("validates")
            .pool
            .expect("pool mode")
            .shm
    };
    let on = shm("").expect("shared by default");
    let pool = validate_yaml(&format!("{base}}}"))
        .expect("validates")
        .pool
        .expect("pool mode");
    assert!(
        !crate::pool::engine_config(&pool, "n").prefer_shm,
        "the agent itself never maps a segment: its own are copied in process"
    );
    assert_eq!(on.socket, Path::new("/run/kv/pool-shm.sock"));
    assert_eq!(on.group, None);
    assert_eq!(shm(", same_node_shm: false"), None);
    let tls = ", transport_tls: require, transport_tls_cert_file: /c.pem, \
               transport_tls_key_file: /k.pem, transport_tls_ca_file: /ca.pem";
    assert_eq!(shm(tls), None, "TLS required: not shared unless asked");
    assert!(shm(&format!("{tls}, same_node_shm: true")).is_some());
    let grouped = validate_yaml(
        "engine_api: {socket_dir: /run/kv, client_group: 1234}\n\
         pool: {master: [m:1], auth_key_file: /k, transport_listen: 127.0.0.1:0}",
    )
    .expect("validates");
    assert_eq!(
        grouped.pool.expect("pool").shm.expect("shared").group,
        Some(1234)
    );
    // The longer of the two socket names must fit a Unix socket path.
    let long = format!("/{}", "d".repeat(94));
    let err = validate_yaml(&format!(
        "engine_api: {{socket_dir: {long}}}\n\
         pool: {{master: [m:1], auth_key_file: /k, transport_listen: 127.0.0.1:0}}"
    ))
    .expect_err("too long");
    assert_eq!(field_of(err), "engine_api.socket_dir");
}
