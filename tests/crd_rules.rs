//! Admission rules of the kvpool CRDs, checked the way an API server checks them: every CEL rule
//! taken from the generated CRD is evaluated against objects that must pass and objects that
//! must fail with that rule's message, and the OpenAPI constraints (ranges, enums, patterns,
//! unknown fields) are checked with a JSON-schema validator on the same schema. The Rust-side
//! `Validated*` checks must reject the same invalid specs. No I/O besides the fixtures.

mod crd_support;

use crd_support::{Kind, admission_errors, all_rules, cel_errors, openapi_errors};
use kvpool_crd::{DecodePool, KVCachePool, PrefillPool};
use serde_json::{Value, json};

/// RFC 7386 merge patch: objects merge, `null` deletes, anything else replaces.
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

fn base(kind: Kind) -> Value {
    match kind {
        Kind::KVCachePool => json!({
            "apiVersion": "kvpool.dev/v1alpha1",
            "kind": "KVCachePool",
            "metadata": {"name": "cache", "namespace": "llm"},
            "spec": {}
        }),
        Kind::PrefillPool | Kind::DecodePool => json!({
            "apiVersion": "kvpool.dev/v1alpha1",
            "kind": kind.name(),
            "metadata": {"name": "engines", "namespace": "llm"},
            "spec": {
                "kvCachePoolRef": {"name": "cache"},
                "engine": {"kind": "vllm", "image": "vllm/vllm-openai:v0.11.0", "model": "Qwen/Qwen3-8B"}
            }
        }),
    }
}

fn with_spec(kind: Kind, spec_patch: &Value) -> Value {
    let mut obj = base(kind);
    merge(&mut obj, &json!({ "spec": spec_patch }));
    obj
}

#[derive(Debug)]
enum Expect {
    /// Accepted.
    Valid,
    /// Rejected by the CEL rule with this exact message (other rules may fail too).
    Cel(&'static str),
    /// Rejected by an OpenAPI keyword; an error mentions this text.
    OpenApi(&'static str),
}

struct Case {
    name: &'static str,
    kinds: &'static [Kind],
    spec: Value,
    /// For transition rules: the spec of the stored object.
    old_spec: Option<Value>,
    /// Replaces the object's `metadata` (for rules on the name).
    metadata: Option<Value>,
    expect: Expect,
}

const POOL: &[Kind] = &[Kind::KVCachePool];
const ALL: &[Kind] = &Kind::ALL;
const ENGINES: &[Kind] = &[Kind::PrefillPool, Kind::DecodePool];

const DRAM_EXCLUSIVE: &str = "dram: set at most one of capacityPerNode and nodeMemoryPercent";
const DRAM_HUGEPAGES: &str = "dram.hugepages requires dram.capacityPerNode: hugepage memory is reserved as an explicit amount";
const NAME: &str = "metadata.name must be at most 53 characters and contain no dots: it prefixes the names of Services";
const DRAM_WHOLE_PAGES: &str =
    "dram.capacityPerNode must be a whole number of hugepages (a multiple of dram.hugepages)";
const DRAM_POSITIVE: &str = "dram.capacityPerNode must be a positive quantity such as 512Gi";
const SSD_POSITIVE: &str = "ssd.capacityPerNode must be a positive quantity such as 3Ti";
const SSD_HOST_PATH: &str = kvpool_crd::SSD_HOST_PATH_MESSAGE;
const DRAM_PERSIST_PATH_REQUIRED: &str =
    "dram.persistence.hostPath is required when dram.persistence.mode is tmpfs or hugetlbfs";
const DRAM_PERSIST_INDEX_REQUIRED: &str = "dram.persistence.indexHostPath (a tmpfs directory) is required with mode hugetlbfs: files on hugetlbfs cannot hold the index";
const DRAM_PERSIST_HUGEPAGES: &str = "dram.persistence.mode hugetlbfs requires dram.hugepages (the agent pod must request the huge pages its files hold)";
const CONDUCTOR_PEER: &str = kvpool_crd::CONDUCTOR_PEER_MESSAGE;
const METRICS_PEER: &str = kvpool_crd::METRICS_PEER_MESSAGE;
const ENGINE_PEER: &str = kvpool_crd::ENGINE_PEER_MESSAGE;
const SRIOV_TCP: &str = "transport.sriov requires transport.protocol rdma or auto";
const SRIOV_ONE_FORM: &str = "transport.sriov: set exactly one of resourceName (one resource for all rails) and resources (one per rail)";
const NETWORKS_TCP: &str = "transport.networks (Multus) requires transport.protocol rdma or auto";
const DEVICES_TCP: &str =
    "transport.devices lists RDMA devices and requires transport.protocol rdma or auto";
const GID_TCP: &str =
    "transport.gidIndex selects an RDMA GID and requires transport.protocol rdma or auto";
const WATERMARKS: &str = "eviction.lowWatermarkPercent must be below eviction.highWatermarkPercent";
const MASTER_HA: &str =
    "master.etcdEndpoints is required when master.replicas is above 1 (HA state lives in etcd)";
const GPUS_TP: &str = "resources.gpus must be a multiple of tensorParallelSize";
const REPLICAS_BOUNDS: &str =
    "replicas must lie within autoscaling.minReplicas..autoscaling.maxReplicas";
const REF_IMMUTABLE: &str = "kvCachePoolRef is immutable; create a new pool instead";
const MODEL_REQUIRED: &str = "engine.model is required for engine.kind vllm and sglang";
const TOKENIZER_ONE_SOURCE: &str =
    "conductor.tokenizer needs exactly one of configMap, persistentVolumeClaim and image";
const TOKENIZER_SUB_PATH: &str =
    "conductor.tokenizer.subPath must be a relative path without '.' or '..' segments";
const TLS_SECRET: &str =
    "master.tls.secretName must be a Secret name (lower-case letters, digits, '-' and '.')";
const TLS_CLIENT_SECRET: &str =
    "master.tls.clientSecretName must be a Secret name (lower-case letters, digits, '-' and '.')";
const TLS_SERVER_NAME: &str =
    "master.tls.serverName must be a DNS name (letters, digits, '-' and dots between labels)";
const TRANSFER_TLS_SECRET: &str =
    "transport.tls.secretName must be a Secret name (lower-case letters, digits, '-' and '.')";
const TRANSFER_TLS_SERVER_NAME: &str =
    "transport.tls.serverName must be a DNS name (letters, digits, '-' and dots between labels)";
const AUTOSCALING_BOUNDS: &str = "autoscaling.minReplicas must not exceed autoscaling.maxReplicas";
const SPREAD_NEEDS_NODE_ACCESS: &str = kvpool_crd::SPREAD_NEEDS_NODE_ACCESS;

impl Case {
    fn object(&self, kind: Kind) -> Value {
        let mut obj = with_spec(kind, &self.spec);
        if let Some(m) = &self.metadata {
            obj["metadata"] = m.clone();
        }
        obj
    }
}

fn cases() -> Vec<Case> {
    use Expect::*;
    let c = |name, kinds, spec, expect| Case {
        name,
        kinds,
        spec,
        old_spec: None,
        metadata: None,
        expect,
    };
    vec![
        // ---- KVCachePool: DRAM
        c("minimal pool", POOL, json!({}), Valid),
        c(
            "dram by quantity",
            POOL,
            json!({"dram": {"capacityPerNode": "512Gi"}}),
            Valid,
        ),
        c(
            "dram by integer bytes",
            POOL,
            json!({"dram": {"capacityPerNode": 68719476736u64}}),
            Valid,
        ),
        c(
            "dram by percent",
            POOL,
            json!({"dram": {"nodeMemoryPercent": 40}}),
            Valid,
        ),
        c(
            "dram both sizes",
            POOL,
            json!({"dram": {"capacityPerNode": "64Gi", "nodeMemoryPercent": 40}}),
            Cel(DRAM_EXCLUSIVE),
        ),
        c(
            "hugepages with quantity",
            POOL,
            json!({"dram": {"capacityPerNode": "64Gi", "hugepages": "1Gi"}}),
            Valid,
        ),
        c(
            "2Mi pages, 3Mi",
            POOL,
            json!({"dram": {"capacityPerNode": "3Mi", "hugepages": "2Mi"}}),
            Cel(DRAM_WHOLE_PAGES),
        ),
        c(
            "1Gi pages, 1536Mi",
            POOL,
            json!({"dram": {"capacityPerNode": "1536Mi", "hugepages": "1Gi"}}),
            Cel(DRAM_WHOLE_PAGES),
        ),
        c(
            "1Gi pages, 1.5Gi",
            POOL,
            json!({"dram": {"capacityPerNode": "1.5Gi", "hugepages": "1Gi"}}),
            Cel(DRAM_WHOLE_PAGES),
        ),
        c(
            "2Mi pages, 1Gi in bytes",
            POOL,
            json!({"dram": {"capacityPerNode": 1073741824, "hugepages": "2Mi"}}),
            Valid,
        ),
        c(
            "2Mi pages, 4M decimal",
            POOL,
            json!({"dram": {"capacityPerNode": "4M", "hugepages": "2Mi"}}),
            Cel(DRAM_WHOLE_PAGES),
        ),
        c(
            "hugepages without quantity",
            POOL,
            json!({"dram": {"hugepages": "2Mi"}}),
            Cel(DRAM_HUGEPAGES),
        ),
        c(
            "hugepages with percent",
            POOL,
            json!({"dram": {"nodeMemoryPercent": 40, "hugepages": "2Mi"}}),
            Cel(DRAM_HUGEPAGES),
        ),
        c(
            "dram zero",
            POOL,
            json!({"dram": {"capacityPerNode": "0"}}),
            Cel(DRAM_POSITIVE),
        ),
        c(
            "dram zero integer",
            POOL,
            json!({"dram": {"capacityPerNode": 0}}),
            Cel(DRAM_POSITIVE),
        ),
        c(
            "dram negative",
            POOL,
            json!({"dram": {"capacityPerNode": "-1Gi"}}),
            Cel(DRAM_POSITIVE),
        ),
        c(
            "dram not a quantity",
            POOL,
            json!({"dram": {"capacityPerNode": "lots"}}),
            Cel(DRAM_POSITIVE),
        ),
        c(
            "dram percent 0",
            POOL,
            json!({"dram": {"nodeMemoryPercent": 0}}),
            OpenApi("nodeMemoryPercent"),
        ),
        c(
            "dram percent 101",
            POOL,
            json!({"dram": {"nodeMemoryPercent": 101}}),
            OpenApi("nodeMemoryPercent"),
        ),
        c(
            "hugepages 4Mi",
            POOL,
            json!({"dram": {"capacityPerNode": "64Gi", "hugepages": "4Mi"}}),
            OpenApi("hugepages"),
        ),
        c(
            "numa policy unknown",
            POOL,
            json!({"dram": {"numaPolicy": "spread"}}),
            OpenApi("numaPolicy"),
        ),
        // ---- DRAM persistence
        c(
            "dram persistence on tmpfs",
            POOL,
            json!({"dram": {"persistence": {"mode": "tmpfs", "hostPath": "/dev/shm/kvpool"}}}),
            Valid,
        ),
        c(
            "dram persistence off ignores its paths",
            POOL,
            json!({"dram": {"persistence": {"mode": "none"}}}),
            Valid,
        ),
        c(
            "dram persistence on hugetlbfs",
            POOL,
            json!({"dram": {"capacityPerNode": "64Gi", "hugepages": "1Gi", "persistence": {
                "mode": "hugetlbfs", "hostPath": "/mnt/huge/kvpool",
                "indexHostPath": "/dev/shm/kvpool-index"}}}),
            Valid,
        ),
        c(
            "dram persistence without a host path",
            POOL,
            json!({"dram": {"persistence": {"mode": "tmpfs"}}}),
            Cel(DRAM_PERSIST_PATH_REQUIRED),
        ),
        c(
            "dram persistence on a system directory",
            POOL,
            json!({"dram": {"persistence": {"mode": "tmpfs", "hostPath": "/etc/kvpool"}}}),
            Cel(kvpool_crd::DRAM_HOST_PATH_MESSAGE),
        ),
        c(
            "dram persistence climbing out",
            POOL,
            json!({"dram": {"persistence": {"mode": "tmpfs", "hostPath": "/dev/shm/../etc"}}}),
            Cel(kvpool_crd::DRAM_HOST_PATH_MESSAGE),
        ),
        c(
            "dram persistence index in the socket directory",
            POOL,
            json!({"dram": {"persistence": {"mode": "tmpfs", "hostPath": "/dev/shm/kv",
                "indexHostPath": "/run/kvpool/index"}}}),
            Cel(kvpool_crd::DRAM_INDEX_HOST_PATH_MESSAGE),
        ),
        c(
            "dram persistence on hugetlbfs without an index directory",
            POOL,
            json!({"dram": {"capacityPerNode": "64Gi", "hugepages": "2Mi", "persistence": {
                "mode": "hugetlbfs", "hostPath": "/dev/hugepages/kv"}}}),
            Cel(DRAM_PERSIST_INDEX_REQUIRED),
        ),
        c(
            "dram persistence on hugetlbfs without hugepages",
            POOL,
            json!({"dram": {"persistence": {"mode": "hugetlbfs",
                "hostPath": "/dev/hugepages/kv", "indexHostPath": "/dev/shm/kv"}}}),
            Cel(DRAM_PERSIST_HUGEPAGES),
        ),
        c(
            "dram persistence mode unknown",
            POOL,
            json!({"dram": {"persistence": {"mode": "disk", "hostPath": "/dev/shm/kv"}}}),
            OpenApi("mode"),
        ),
        // ---- SSD
        c(
            "ssd",
            POOL,
            json!({"ssd": {"hostPath": "/mnt/nvme/kvpool", "capacityPerNode": "3Ti"}}),
            Valid,
        ),
        c(
            "ssd zero",
            POOL,
            json!({"ssd": {"hostPath": "/mnt/nvme", "capacityPerNode": "0Ti"}}),
            Cel(SSD_POSITIVE),
        ),
        c(
            "ssd relative path",
            POOL,
            json!({"ssd": {"hostPath": "mnt/nvme", "capacityPerNode": "3Ti"}}),
            OpenApi("hostPath"),
        ),
        c(
            "ssd root path",
            POOL,
            json!({"ssd": {"hostPath": "/", "capacityPerNode": "3Ti"}}),
            OpenApi("hostPath"),
        ),
        c(
            "ssd below /data with a trailing slash",
            POOL,
            json!({"ssd": {"hostPath": "/data/kv/", "capacityPerNode": "3Ti"}}),
            Valid,
        ),
        c(
            "ssd below /var/lib/kvpool",
            POOL,
            json!({"ssd": {"hostPath": "/var/lib/kvpool/ssd", "capacityPerNode": "3Ti"}}),
            Valid,
        ),
        c(
            "ssd in a system directory",
            POOL,
            json!({"ssd": {"hostPath": "/etc", "capacityPerNode": "3Ti"}}),
            Cel(SSD_HOST_PATH),
        ),
        c(
            "ssd in the kubelet's directory",
            POOL,
            json!({"ssd": {"hostPath": "/var/lib/kubelet", "capacityPerNode": "3Ti"}}),
            Cel(SSD_HOST_PATH),
        ),
        c(
            "ssd with a doubled slash",
            POOL,
            json!({"ssd": {"hostPath": "//mnt/nvme", "capacityPerNode": "3Ti"}}),
            Cel(SSD_HOST_PATH),
        ),
        c(
            "ssd with an empty segment",
            POOL,
            json!({"ssd": {"hostPath": "/mnt//nvme", "capacityPerNode": "3Ti"}}),
            Cel(SSD_HOST_PATH),
        ),
        c(
            "ssd climbing out of /mnt",
            POOL,
            json!({"ssd": {"hostPath": "/mnt/../etc", "capacityPerNode": "3Ti"}}),
            Cel(SSD_HOST_PATH),
        ),
        c(
            "ssd ending in ..",
            POOL,
            json!({"ssd": {"hostPath": "/mnt/nvme/..", "capacityPerNode": "3Ti"}}),
            Cel(SSD_HOST_PATH),
        ),
        c(
            "ssd the prefix itself",
            POOL,
            json!({"ssd": {"hostPath": "/mnt/", "capacityPerNode": "3Ti"}}),
            Cel(SSD_HOST_PATH),
        ),
        c(
            "ssd without capacity",
            POOL,
            json!({"ssd": {"hostPath": "/mnt/nvme"}}),
            OpenApi("capacityPerNode"),
        ),
        // ---- network policies
        c(
            "network policies with named peers",
            POOL,
            json!({"networkPolicy": {
                "conductorFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}, {"ipBlock": {"cidr": "10.0.0.0/8"}}],
                "metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
            }}),
            Valid,
        ),
        c(
            "network policies off",
            POOL,
            json!({"networkPolicy": {"enabled": false}}),
            Valid,
        ),
        c(
            "conductor peer with ipBlock and a selector",
            POOL,
            json!({"networkPolicy": {"conductorFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}}),
            Cel(CONDUCTOR_PEER),
        ),
        c(
            "empty metrics peer",
            POOL,
            json!({"networkPolicy": {"metricsFrom": [{}]}}),
            Cel(METRICS_PEER),
        ),
        c(
            "engine callers by namespace",
            POOL,
            json!({"networkPolicy": {"engineFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "router"}}}]}}),
            Valid,
        ),
        c(
            "engine peer with ipBlock and a selector",
            POOL,
            json!({"networkPolicy": {"engineFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "namespaceSelector": {}}]}}),
            Cel(ENGINE_PEER),
        ),
        // ---- transport
        c(
            "rdma with sriov and networks",
            POOL,
            json!({"transport": {"protocol": "rdma", "devices": ["mlx5_0"], "sriov": {"resourceName": "nvidia.com/rdma_vf", "count": 8}, "networks": ["kvpool/roce"]}}),
            Valid,
        ),
        c(
            "auto with sriov",
            POOL,
            json!({"transport": {"sriov": {"resourceName": "nvidia.com/rdma_vf"}}}),
            Valid,
        ),
        c(
            "tcp with sriov",
            POOL,
            json!({"transport": {"protocol": "tcp", "sriov": {"resourceName": "nvidia.com/rdma_vf"}}}),
            Cel(SRIOV_TCP),
        ),
        c(
            "tcp with networks",
            POOL,
            json!({"transport": {"protocol": "tcp", "networks": ["roce"]}}),
            Cel(NETWORKS_TCP),
        ),
        c(
            "tcp with devices",
            POOL,
            json!({"transport": {"protocol": "tcp", "devices": ["mlx5_0"]}}),
            Cel(DEVICES_TCP),
        ),
        c(
            "rdma with a gid index",
            POOL,
            json!({"transport": {"protocol": "rdma", "gidIndex": 3}}),
            Valid,
        ),
        c(
            "tcp with a gid index",
            POOL,
            json!({"transport": {"protocol": "tcp", "gidIndex": 3}}),
            Cel(GID_TCP),
        ),
        c(
            "gid index above the table",
            POOL,
            json!({"transport": {"protocol": "auto", "gidIndex": 256}}),
            OpenApi("gidIndex"),
        ),
        c(
            "duplicate networks",
            POOL,
            json!({"transport": {"networks": ["rail-0", "rail-0"]}}),
            OpenApi("networks"),
        ),
        c(
            "duplicate etcd endpoints",
            POOL,
            json!({"master": {"replicas": 3, "etcdEndpoints": ["http://e:2379", "http://e:2379"]}}),
            OpenApi("etcdEndpoints"),
        ),
        c(
            "tcp plain",
            POOL,
            json!({"transport": {"protocol": "tcp", "port": 20000}}),
            Valid,
        ),
        c(
            "protocol udp",
            POOL,
            json!({"transport": {"protocol": "udp"}}),
            OpenApi("protocol"),
        ),
        c(
            "privileged port",
            POOL,
            json!({"transport": {"port": 80}}),
            OpenApi("port"),
        ),
        c(
            "sriov bad resource name",
            POOL,
            json!({"transport": {"sriov": {"resourceName": "nvidia.com/rdma vf"}}}),
            OpenApi("resourceName"),
        ),
        c(
            "sriov zero count",
            POOL,
            json!({"transport": {"sriov": {"resourceName": "nvidia.com/rdma_vf", "count": 0}}}),
            OpenApi("count"),
        ),
        c(
            "sriov one resource per rail",
            POOL,
            json!({"transport": {"protocol": "rdma", "sriov": {"resources": [
                {"resourceName": "nvidia.com/rdma_vf_rail0"},
                {"resourceName": "nvidia.com/rdma_vf_rail1", "count": 2}]}}}),
            Valid,
        ),
        c(
            "sriov both forms",
            POOL,
            json!({"transport": {"sriov": {"resourceName": "nvidia.com/rdma_vf",
                "resources": [{"resourceName": "nvidia.com/rdma_vf_rail0"}]}}}),
            Cel(SRIOV_ONE_FORM),
        ),
        c(
            "sriov neither form",
            POOL,
            json!({"transport": {"sriov": {"count": 2}}}),
            Cel(SRIOV_ONE_FORM),
        ),
        c(
            "sriov empty rail list",
            POOL,
            json!({"transport": {"sriov": {"resources": []}}}),
            Cel(SRIOV_ONE_FORM),
        ),
        c(
            "sriov rail listed twice",
            POOL,
            json!({"transport": {"sriov": {"resources": [
                {"resourceName": "nvidia.com/rdma_vf_rail0"},
                {"resourceName": "nvidia.com/rdma_vf_rail0"}]}}}),
            OpenApi("resources"),
        ),
        c(
            "sriov rail bad resource name",
            POOL,
            json!({"transport": {"sriov": {"resources": [{"resourceName": "rail 0"}]}}}),
            OpenApi("resourceName"),
        ),
        c(
            "sriov rail zero count",
            POOL,
            json!({"transport": {"sriov": {"resources": [{"resourceName": "a/b", "count": 0}]}}}),
            OpenApi("count"),
        ),
        // ---- block size, replication
        c(
            "block size 0",
            POOL,
            json!({"blockSizeTokens": 0}),
            OpenApi("blockSizeTokens"),
        ),
        c(
            "replicas 8",
            POOL,
            json!({"replication": {"replicas": 8}}),
            Valid,
        ),
        c(
            "replicas 9",
            POOL,
            json!({"replication": {"replicas": 9}}),
            OpenApi("replicas"),
        ),
        c(
            "replicas 0",
            POOL,
            json!({"replication": {"replicas": 0}}),
            OpenApi("replicas"),
        ),
        c(
            "spread over zones with an agent service account",
            POOL,
            json!({"replication": {"replicas": 2, "spreadLabelKey": "topology.kubernetes.io/zone"},
                   "agent": {"serviceAccountName": "kvpool-agent"}}),
            Valid,
        ),
        c(
            "spread over zones without node access",
            POOL,
            json!({"replication": {"spreadLabelKey": "topology.kubernetes.io/zone"}}),
            Cel(SPREAD_NEEDS_NODE_ACCESS),
        ),
        c(
            "spread label key not a label key",
            POOL,
            json!({"replication": {"spreadLabelKey": "Rack Label"},
                   "agent": {"serviceAccountName": "kvpool-agent"}}),
            OpenApi("spreadLabelKey"),
        ),
        c(
            "agent service account not a name",
            POOL,
            json!({"agent": {"serviceAccountName": "Kvpool_Agent"}}),
            OpenApi("serviceAccountName"),
        ),
        // ---- eviction
        c(
            "every eviction policy",
            POOL,
            json!({"eviction": {"policy": "s3fifo"}}),
            Valid,
        ),
        c(
            "watermarks equal",
            POOL,
            json!({"eviction": {"highWatermarkPercent": 85, "lowWatermarkPercent": 85}}),
            Cel(WATERMARKS),
        ),
        c(
            "watermarks inverted",
            POOL,
            json!({"eviction": {"highWatermarkPercent": 70, "lowWatermarkPercent": 80}}),
            Cel(WATERMARKS),
        ),
        c(
            "low above default high",
            POOL,
            json!({"eviction": {"lowWatermarkPercent": 95}}),
            Cel(WATERMARKS),
        ),
        c(
            "watermarks ok",
            POOL,
            json!({"eviction": {"highWatermarkPercent": 95, "lowWatermarkPercent": 60, "policy": "lfu"}}),
            Valid,
        ),
        c(
            "eviction policy unknown",
            POOL,
            json!({"eviction": {"policy": "random"}}),
            OpenApi("policy"),
        ),
        // ---- master, conductor
        c(
            "master ha",
            POOL,
            json!({"master": {"replicas": 3, "etcdEndpoints": ["http://etcd-0.etcd:2379"]}}),
            Valid,
        ),
        c(
            "master replicas without etcd",
            POOL,
            json!({"master": {"replicas": 3}}),
            Cel(MASTER_HA),
        ),
        c(
            "etcd endpoint without scheme",
            POOL,
            json!({"master": {"etcdEndpoints": ["etcd:2379"]}}),
            OpenApi("etcdEndpoints"),
        ),
        c(
            "conductor off",
            POOL,
            json!({"conductor": {"enabled": false}}),
            Valid,
        ),
        c(
            "conductor slo zero",
            POOL,
            json!({"conductor": {"slo": {"ttftMillis": 0}}}),
            OpenApi("ttftMillis"),
        ),
        c(
            "conductor engine block size and tokenizer",
            POOL,
            json!({"conductor": {"engineBlockSize": 32,
                "tokenizer": {"persistentVolumeClaim": "models", "subPath": "Qwen/Qwen2.5-7B-Instruct"}}}),
            Valid,
        ),
        c(
            "conductor engine block size zero",
            POOL,
            json!({"conductor": {"engineBlockSize": 0}}),
            OpenApi("engineBlockSize"),
        ),
        c(
            "tokenizer without a source",
            POOL,
            json!({"conductor": {"tokenizer": {"subPath": "m"}}}),
            Cel(TOKENIZER_ONE_SOURCE),
        ),
        c(
            "tokenizer with two sources",
            POOL,
            json!({"conductor": {"tokenizer": {"configMap": "tok", "image": "registry.example/tok:1"}}}),
            Cel(TOKENIZER_ONE_SOURCE),
        ),
        c(
            "tokenizer sub-path climbing out",
            POOL,
            json!({"conductor": {"tokenizer": {"configMap": "tok", "subPath": "a/../../etc"}}}),
            Cel(TOKENIZER_SUB_PATH),
        ),
        c(
            "tokenizer absolute sub-path",
            POOL,
            json!({"conductor": {"tokenizer": {"image": "registry.example/tok:1", "subPath": "/etc"}}}),
            Cel(TOKENIZER_SUB_PATH),
        ),
        // ---- KVCachePool: master TLS
        c(
            "master tls with every field",
            POOL,
            json!({"master": {"tls": {"secretName": "cache-master-tls",
                "clientSecretName": "cache-client.tls", "serverName": "master.kvpool.example"}}}),
            Valid,
        ),
        c(
            "master tls secret with upper case",
            POOL,
            json!({"master": {"tls": {"secretName": "Cache-TLS"}}}),
            Cel(TLS_SECRET),
        ),
        c(
            "master tls client secret with a slash",
            POOL,
            json!({"master": {"tls": {"secretName": "t", "clientSecretName": "a/b"}}}),
            Cel(TLS_CLIENT_SECRET),
        ),
        c(
            "master tls server name with a space",
            POOL,
            json!({"master": {"tls": {"secretName": "t", "serverName": "master .example"}}}),
            Cel(TLS_SERVER_NAME),
        ),
        // ---- KVCachePool: transfer TLS
        c(
            "transfer tls with every field",
            POOL,
            json!({"transport": {"tls": {"secretName": "cache-transfer-tls", "mode": "allow",
                "serverName": "agents.kvpool.example"}}}),
            Valid,
        ),
        c(
            "transfer tls secret with upper case",
            POOL,
            json!({"transport": {"tls": {"secretName": "Agents"}}}),
            Cel(TRANSFER_TLS_SECRET),
        ),
        c(
            "transfer tls server name with a space",
            POOL,
            json!({"transport": {"tls": {"secretName": "t", "serverName": "agents .example"}}}),
            Cel(TRANSFER_TLS_SERVER_NAME),
        ),
        c(
            "transfer tls with an unknown mode",
            POOL,
            json!({"transport": {"tls": {"secretName": "t", "mode": "always"}}}),
            OpenApi("mode"),
        ),
        c(
            "master tls without a secret",
            POOL,
            json!({"master": {"tls": {"serverName": "m.example"}}}),
            OpenApi("secretName"),
        ),
        c(
            "unknown field",
            POOL,
            json!({"dram": {"capacity": "64Gi"}}),
            OpenApi("capacity"),
        ),
        // ---- engine pools
        c("minimal engines", ENGINES, json!({}), Valid),
        c(
            "tp 4 on 8 gpus",
            ENGINES,
            json!({"tensorParallelSize": 4, "resources": {"gpus": 8}}),
            Valid,
        ),
        c(
            "tp 4 on 2 gpus",
            ENGINES,
            json!({"tensorParallelSize": 4, "resources": {"gpus": 2}}),
            Cel(GPUS_TP),
        ),
        c(
            "tp 3 on 8 gpus",
            ENGINES,
            json!({"tensorParallelSize": 3, "resources": {"gpus": 8}}),
            Cel(GPUS_TP),
        ),
        c(
            "cpu-only custom engine",
            ENGINES,
            json!({"resources": {"gpus": 0}, "engine": {"kind": "custom", "model": null}}),
            Valid,
        ),
        c(
            "vllm without model",
            ENGINES,
            json!({"engine": {"model": null}}),
            Cel(MODEL_REQUIRED),
        ),
        c(
            "sglang without model",
            ENGINES,
            json!({"engine": {"kind": "sglang", "model": null}}),
            Cel(MODEL_REQUIRED),
        ),
        c(
            "engine kind unknown",
            ENGINES,
            json!({"engine": {"kind": "trtllm"}}),
            OpenApi("kind"),
        ),
        c(
            "engine without image",
            ENGINES,
            json!({"engine": {"image": null}}),
            OpenApi("image"),
        ),
        c(
            "autoscaling ok",
            ENGINES,
            json!({"replicas": 2, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}}),
            Valid,
        ),
        c(
            "replicas above max",
            ENGINES,
            json!({"replicas": 6, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}}),
            Cel(REPLICAS_BOUNDS),
        ),
        c(
            "replicas below min",
            ENGINES,
            json!({"replicas": 1, "autoscaling": {"minReplicas": 2, "maxReplicas": 4}}),
            Cel(REPLICAS_BOUNDS),
        ),
        c(
            "min above max",
            ENGINES,
            json!({"replicas": 3, "autoscaling": {"minReplicas": 5, "maxReplicas": 2}}),
            Cel(AUTOSCALING_BOUNDS),
        ),
        c(
            "autoscaling signal unknown",
            ENGINES,
            json!({"autoscaling": {"maxReplicas": 2, "signal": "cpu"}}),
            OpenApi("signal"),
        ),
        c(
            "pool ref bad name",
            ENGINES,
            json!({"kvCachePoolRef": {"name": "Cache_1"}}),
            OpenApi("name"),
        ),
        c(
            "pool ref missing",
            ENGINES,
            json!({"kvCachePoolRef": null}),
            OpenApi("kvCachePoolRef"),
        ),
        c(
            "tp 0",
            ENGINES,
            json!({"tensorParallelSize": 0}),
            OpenApi("tensorParallelSize"),
        ),
        Case {
            name: "53-character name",
            kinds: ALL,
            spec: json!({}),
            old_spec: None,
            metadata: Some(json!({"name": "a".repeat(53), "namespace": "llm"})),
            expect: Valid,
        },
        // ---- Pull secrets, the conductor's API keys, the engine pod template (issue 34)
        c(
            "pull secrets and API key Secrets",
            POOL,
            json!({
                "imagePullSecrets": [{"name": "registry-credentials"}],
                "conductor": {
                    "apiKeySecret": {"name": "conductor-api-keys", "key": "keys"},
                    "engineApiKeySecret": {"name": "vllm-api-key", "key": "token"}
                }
            }),
            Valid,
        ),
        c(
            "API key Secret without a key",
            POOL,
            json!({"conductor": {"apiKeySecret": {"name": "conductor-api-keys"}}}),
            OpenApi("\"key\" is a required property"),
        ),
        c(
            "API key Secret with an upper-case name",
            POOL,
            json!({"conductor": {"engineApiKeySecret": {"name": "Keys", "key": "token"}}}),
            OpenApi("does not match"),
        ),
        c(
            "API key Secret key with a slash",
            POOL,
            json!({"conductor": {"apiKeySecret": {"name": "keys", "key": "a/b"}}}),
            OpenApi("does not match"),
        ),
        c(
            "a real engine's pod template",
            ENGINES,
            json!({"template": {
                "metadata": {"labels": {"team": "ml"}, "annotations": {"example.com/owner": "ml"}},
                "spec": {
                    "imagePullSecrets": [{"name": "registry-credentials"}],
                    "volumes": [
                        {"name": "model-cache", "persistentVolumeClaim": {"claimName": "weights", "readOnly": true}},
                        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}}
                    ],
                    "containers": [
                        {"name": "engine", "volumeMounts": [{"name": "model-cache", "mountPath": "/models"}],
                         "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "failureThreshold": 90}},
                        {"name": "shipper", "image": "fluent/fluent-bit:3.1"}
                    ],
                    "initContainers": [{"name": "fetch", "image": "busybox", "restartPolicy": "Always"}],
                    "nodeSelector": {"zone": "a"},
                    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}],
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}},
                    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}],
                    "serviceAccountName": "engines",
                    "automountServiceAccountToken": true,
                    "priorityClassName": "inference-high",
                    "runtimeClassName": "nvidia",
                    "schedulerName": "volcano",
                    "terminationGracePeriodSeconds": 120,
                    "securityContext": {"runAsUser": 1000}
                }
            }}),
            Valid,
        ),
        c(
            "a pod field the template does not offer",
            ENGINES,
            json!({"template": {"spec": {"hostNetwork": true}}}),
            OpenApi("hostNetwork"),
        ),
        c(
            "a template container without a name",
            ENGINES,
            json!({"template": {"spec": {"containers": [{"image": "busybox"}]}}}),
            OpenApi("\"name\" is a required property"),
        ),
        c(
            "a template volume without a name",
            ENGINES,
            json!({"template": {"spec": {"volumes": [{"emptyDir": {}}]}}}),
            OpenApi("\"name\" is a required property"),
        ),
        c(
            "a negative grace period",
            ENGINES,
            json!({"template": {"spec": {"terminationGracePeriodSeconds": -1}}}),
            OpenApi("terminationGracePeriodSeconds"),
        ),
        Case {
            name: "54-character name",
            kinds: ALL,
            spec: json!({}),
            old_spec: None,
            metadata: Some(json!({"name": "a".repeat(54), "namespace": "llm"})),
            expect: Cel(NAME),
        },
        Case {
            name: "dotted name",
            kinds: ALL,
            spec: json!({}),
            old_spec: None,
            metadata: Some(json!({"name": "cache.v2", "namespace": "llm"})),
            expect: Cel(NAME),
        },
        Case {
            name: "pool ref unchanged on update",
            kinds: ENGINES,
            spec: json!({"replicas": 3}),
            old_spec: Some(json!({})),
            metadata: None,
            expect: Valid,
        },
        Case {
            name: "pool ref changed on update",
            kinds: ENGINES,
            spec: json!({"kvCachePoolRef": {"name": "other"}}),
            old_spec: Some(json!({})),
            metadata: None,
            expect: Cel(REF_IMMUTABLE),
        },
    ]
}

#[test]
fn every_case_is_accepted_or_rejected_as_expected() {
    let mut failures = Vec::new();
    for case in cases() {
        for &kind in case.kinds {
            let obj = case.object(kind);
            let old = case.old_spec.as_ref().map(|s| with_spec(kind, s));
            let label = format!("{} / {}", kind.name(), case.name);
            match &case.expect {
                Expect::Valid => {
                    let errors = admission_errors(kind, &obj, old.as_ref());
                    if !errors.is_empty() {
                        failures.push(format!("{label}: expected valid, got {errors:?}"));
                    }
                }
                Expect::Cel(message) => {
                    let openapi = openapi_errors(kind, &obj);
                    if !openapi.is_empty() {
                        failures.push(format!(
                            "{label}: expected only CEL failures, OpenAPI says {openapi:?}"
                        ));
                    }
                    let errors = cel_errors(kind, &obj, old.as_ref());
                    if !errors.iter().any(|e| e == message) {
                        failures.push(format!(
                            "{label}: expected CEL message {message:?}, got {errors:?}"
                        ));
                    }
                }
                Expect::OpenApi(fragment) => {
                    let errors = openapi_errors(kind, &obj);
                    if !errors.iter().any(|e| e.contains(fragment)) {
                        failures.push(format!(
                            "{label}: expected an OpenAPI error about {fragment:?}, got {errors:?}"
                        ));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[test]
fn every_generated_rule_has_a_failing_case() {
    let cases = cases();
    let mut missing = Vec::new();
    for (kind, rule) in all_rules() {
        let covered = cases.iter().any(|c| {
            c.kinds.contains(&kind) && matches!(c.expect, Expect::Cel(m) if m == rule.message)
        });
        if !covered {
            missing.push(format!(
                "{} {} `{}`: {:?}",
                kind.name(),
                rule.path,
                rule.rule,
                rule.message
            ));
        }
    }
    assert!(
        missing.is_empty(),
        "CEL rules without a failing case:\n{}",
        missing.join("\n")
    );
    // and no case expects a message that no rule produces
    let messages: Vec<String> = all_rules().into_iter().map(|(_, r)| r.message).collect();
    for c in &cases {
        if let Expect::Cel(m) = c.expect {
            assert!(
                messages.iter().any(|x| x == m),
                "case {:?} expects unknown message {m:?}",
                c.name
            );
        }
    }
}

/// Every failure is reported on the field it is about, and its message starts with that field
/// (the path below `spec`), so `kubectl apply` points at what to fix.
#[test]
fn failures_are_reported_on_the_field_their_message_names() {
    let mut problems = Vec::new();
    for case in cases() {
        if !matches!(case.expect, Expect::Cel(_)) {
            continue;
        }
        for &kind in case.kinds {
            let obj = case.object(kind);
            let old = case.old_spec.as_ref().map(|s| with_spec(kind, s));
            for f in crd_support::cel_failures(kind, &obj, old.as_ref()) {
                // root rules (on the name) report at the root and name `metadata.name`
                // a rule on the items of a list reports at `list[i]` and names the list
                let path = unindexed(&f.path);
                let field = if path.is_empty() {
                    "metadata.name"
                } else {
                    path.strip_prefix("spec.").unwrap_or(&path)
                };
                let named = f
                    .message
                    .strip_prefix(field)
                    .is_some_and(|rest| rest.starts_with([' ', ':']));
                if !(f.path.is_empty() || f.path.starts_with("spec.")) || !named {
                    problems.push(format!("{} / {}: {f}", kind.name(), case.name));
                }
            }
        }
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

/// `a.b[3].c[0]` without its list indices: `a.b.c`.
fn unindexed(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut depth = 0;
    for ch in path.chars() {
        match ch {
            '[' => depth += 1,
            ']' => depth -= 1,
            _ if depth == 0 => out.push(ch),
            _ => {}
        }
    }
    out
}

/// The operator's Rust checks reject what the API server rejects (for specs that parse).
#[test]
fn rust_validation_agrees_with_cel() {
    let mut disagreements = Vec::new();
    for case in cases() {
        if case.old_spec.is_some() || matches!(case.expect, Expect::OpenApi(_)) {
            continue;
        }
        for &kind in case.kinds {
            let obj = case.object(kind);
            let rust = crd_support::rust_validation(kind, &obj);
            let expected_ok = matches!(case.expect, Expect::Valid);
            if rust.is_ok() != expected_ok {
                disagreements.push(format!(
                    "{} / {}: Rust says {rust:?}, expected {:?}",
                    kind.name(),
                    case.name,
                    case.expect
                ));
            }
        }
    }
    assert!(disagreements.is_empty(), "\n{}", disagreements.join("\n"));
}

/// Walks a compiled schema along a `rules()` path (`spec.dram`, `spec.tolerations[]`).
fn compiled_at<'a>(root: &'a kube_cel::CompiledSchema, path: &str) -> &'a kube_cel::CompiledSchema {
    let mut node = root;
    for seg in path.split('.').filter(|s| !s.is_empty()) {
        let (name, items) = match seg.strip_suffix("[]") {
            Some(n) => (n, true),
            None => (seg, false),
        };
        node = node
            .properties
            .get(name)
            .unwrap_or_else(|| panic!("no property {name} in {path}"));
        if items {
            node = node.items.as_deref().expect("array items");
        }
    }
    node
}

#[test]
fn every_rule_compiles_and_stays_within_the_api_servers_cost_budget() {
    for kind in Kind::ALL {
        let schema = crd_support::schema(kind);
        let compiled = kube_cel::compile_schema(&schema);
        for r in crd_support::rules(&schema) {
            let node = compiled_at(&compiled, &r.path);
            assert!(
                !node.has_errors(),
                "{} {}: {:?}",
                kind.name(),
                r.path,
                node.compilation_errors()
            );
            let warnings =
                kube_cel::analyze_rule(&r.rule, node, kube_cel::ScopeContext::CrdValidation);
            assert!(
                warnings.is_empty(),
                "{} {} `{}`: {warnings:?}",
                kind.name(),
                r.path,
                r.rule
            );
        }
    }
}

/// What Rust fills in for an absent field (serde defaults) is what the API server fills in
/// (schema defaults), so the operator and `kubectl get -o yaml` agree on the effective spec.
#[test]
fn serde_defaults_equal_schema_defaults() {
    for kind in Kind::ALL {
        let minimal = base(kind);
        let defaulted = kube_cel::apply_defaults(&crd_support::schema(kind), &minimal);
        assert_ne!(
            defaulted,
            minimal,
            "{}: the schema declares defaults",
            kind.name()
        );
        let (from_minimal, from_defaulted) = match kind {
            Kind::KVCachePool => (
                serde_json::to_value(
                    serde_json::from_value::<KVCachePool>(minimal)
                        .expect("parses")
                        .spec,
                ),
                serde_json::to_value(
                    serde_json::from_value::<KVCachePool>(defaulted)
                        .expect("parses")
                        .spec,
                ),
            ),
            Kind::PrefillPool => (
                serde_json::to_value(
                    serde_json::from_value::<PrefillPool>(minimal)
                        .expect("parses")
                        .spec,
                ),
                serde_json::to_value(
                    serde_json::from_value::<PrefillPool>(defaulted)
                        .expect("parses")
                        .spec,
                ),
            ),
            Kind::DecodePool => (
                serde_json::to_value(
                    serde_json::from_value::<DecodePool>(minimal)
                        .expect("parses")
                        .spec,
                ),
                serde_json::to_value(
                    serde_json::from_value::<DecodePool>(defaulted)
                        .expect("parses")
                        .spec,
                ),
            ),
        };
        assert_eq!(
            from_minimal.expect("serializes"),
            from_defaulted.expect("serializes"),
            "{}",
            kind.name()
        );
    }
}

mod agreement {
    //! Random KVCachePool and engine pool specs, mostly near the edges of what is allowed: the API
    //! server's checks (OpenAPI + CEL) and the operator's Rust checks must agree on every one.

    use super::*;
    use proptest::prelude::*;
    use proptest::sample::select;

    fn opt<T: Clone + std::fmt::Debug + 'static>(
        values: Vec<T>,
    ) -> impl Strategy<Value = Option<T>> {
        // mostly absent (the valid default), so that one bad field at a time decides the outcome
        proptest::option::weighted(0.3, select(values))
    }

    fn pool_spec() -> impl Strategy<Value = Value> {
        let dram = (
            opt(vec![
                json!("0"),
                json!("1Gi"),
                json!("512Gi"),
                json!("-1Gi"),
                json!("lots"),
                json!("3Mi"),
                json!("1536Mi"),
                json!(0),
                json!(1u64 << 30),
            ]),
            opt(vec![0, 1, 25, 100, 101]),
            opt(vec!["none", "2Mi", "1Gi"]),
        )
            .prop_map(|(cap, pct, huge)| {
                let mut d = json!({});
                if let Some(c) = cap {
                    d["capacityPerNode"] = c;
                }
                if let Some(p) = pct {
                    d["nodeMemoryPercent"] = json!(p);
                }
                if let Some(h) = huge {
                    d["hugepages"] = json!(h);
                }
                d
            });
        let ssd = opt(vec![
            json!({"hostPath": "/mnt/nvme", "capacityPerNode": "3Ti"}),
            json!({"hostPath": "/mnt/nvme", "capacityPerNode": "0"}),
            json!({"hostPath": "relative", "capacityPerNode": "3Ti"}),
            json!({"hostPath": "/", "capacityPerNode": "3Ti"}),
            json!({"hostPath": "/etc/kvpool", "capacityPerNode": "3Ti"}),
            json!({"hostPath": "/mnt/a/../b", "capacityPerNode": "3Ti"}),
            json!({"hostPath": "/data/kv/", "capacityPerNode": "3Ti"}),
        ]);
        let transport = (
            opt(vec!["auto", "rdma", "tcp"]),
            any::<bool>(),
            0usize..4,
            0usize..2,
            opt(vec![80, 1024, 15500, 65535, 70000]),
        )
            .prop_map(|(proto, sriov, nets, devs, port)| {
                let mut t = json!({});
                if let Some(p) = proto {
                    t["protocol"] = json!(p);
                }
                if sriov {
                    t["sriov"] = json!({"resourceName": "nvidia.com/roce_vf"});
                }
                // three networks repeat one name, which the API server rejects (a set)
                t["networks"] = json!(
                    (0..nets)
                        .map(|i| format!("rail-{}", i % 2))
                        .collect::<Vec<_>>()
                );
                t["devices"] = json!((0..devs).map(|i| format!("mlx5_{i}")).collect::<Vec<_>>());
                if let Some(p) = port {
                    t["port"] = json!(p);
                }
                t
            });
        let rest = (
            opt(vec![0, 1, 512, 65536, 65537]),
            opt(vec![0, 1, 8, 9]),
            (
                opt(vec![0, 1, 50, 80, 90, 99, 100, 101]),
                opt(vec![0, 1, 50, 80, 90, 99, 100]),
            ),
            (opt(vec![0, 1, 3, 6]), 0usize..3, any::<bool>()),
            (
                any::<bool>(),
                opt(vec![0, 1, 16, 17]),
                opt(vec![0, 1, 2000]),
                opt(vec![0, 100, 60001]),
            ),
        );
        (dram, ssd, transport, rest).prop_map(
            |(dram, ssd, transport, (block, repl, (high, low), master, conductor))| {
                let mut spec = json!({"dram": dram, "transport": transport});
                if let Some(s) = ssd {
                    spec["ssd"] = s;
                }
                if let Some(b) = block {
                    spec["blockSizeTokens"] = json!(b);
                }
                if let Some(r) = repl {
                    spec["replication"] = json!({"replicas": r});
                }
                let mut eviction = json!({});
                if let Some(h) = high {
                    eviction["highWatermarkPercent"] = json!(h);
                }
                if let Some(l) = low {
                    eviction["lowWatermarkPercent"] = json!(l);
                }
                spec["eviction"] = eviction;
                let (replicas, endpoints, bad_scheme) = master;
                let mut m = json!({});
                if let Some(r) = replicas {
                    m["replicas"] = json!(r);
                }
                let scheme = if bad_scheme { "" } else { "http://" };
                m["etcdEndpoints"] = json!(
                    (0..endpoints)
                        .map(|i| format!("{scheme}etcd-{i}:2379"))
                        .collect::<Vec<_>>()
                );
                spec["master"] = m;
                let (enabled, creplicas, ttft, tpot) = conductor;
                let mut c = json!({"enabled": enabled, "slo": {}});
                if let Some(r) = creplicas {
                    c["replicas"] = json!(r);
                }
                if let Some(t) = ttft {
                    c["slo"]["ttftMillis"] = json!(t);
                }
                if let Some(t) = tpot {
                    c["slo"]["tpotMillis"] = json!(t);
                }
                spec["conductor"] = c;
                spec
            },
        )
    }

    /// An engine pool spec without `slo`, and the SLO milliseconds to put under the kind's key.
    fn engine_spec() -> impl Strategy<Value = (Value, Option<i32>)> {
        (
            select(vec!["vllm", "sglang", "custom"]),
            any::<bool>(),
            opt(vec![-1, 0, 1, 4, 1024, 1025]),
            opt(vec![0, 1, 2, 3, 8, 65]),
            opt(vec![0, 1, 2, 4, 65]),
            opt(vec![(0, 1), (1, 4), (2, 2), (5, 2), (1, 1025)]),
            opt(vec![0, 1, 2000]),
        )
            .prop_map(|(kind, model, replicas, gpus, tp, autoscaling, slo)| {
                let mut engine = json!({"kind": kind, "image": "registry.example/engine:1"});
                if model {
                    engine["model"] = json!("org/model");
                }
                let mut spec = json!({"kvCachePoolRef": {"name": "cache"}, "engine": engine});
                if let Some(r) = replicas {
                    spec["replicas"] = json!(r);
                }
                if let Some(g) = gpus {
                    spec["resources"] = json!({"gpus": g});
                }
                if let Some(t) = tp {
                    spec["tensorParallelSize"] = json!(t);
                }
                if let Some((min, max)) = autoscaling {
                    spec["autoscaling"] = json!({"minReplicas": min, "maxReplicas": max});
                }
                (spec, slo)
            })
    }

    fn agree(kind: Kind, spec: &Value) -> Result<(), TestCaseError> {
        let mut obj = base(kind);
        obj["spec"] = spec.clone();
        let api = admission_errors(kind, &obj, None);
        let rust = crd_support::rust_validation(kind, &obj);
        prop_assert_eq!(
            api.is_empty(),
            rust.is_ok(),
            "API server: {:?}\nRust: {:?}\nspec: {}",
            api,
            rust,
            spec
        );
        Ok(())
    }

    proptest! {
        // A fixed seed keeps CI deterministic; change it (or raise `cases`) to explore further.
        #![proptest_config(ProptestConfig {
            cases: 512,
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x6b76_706f_6f6c),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn api_server_and_operator_agree_on_kvcachepools(spec in pool_spec()) {
            agree(Kind::KVCachePool, &spec)?;
        }

        #[test]
        fn api_server_and_operator_agree_on_engine_pools((spec, slo) in engine_spec()) {
            for (kind, key) in [(Kind::PrefillPool, "ttftMillis"), (Kind::DecodePool, "tpotMillis")] {
                let mut spec = spec.clone();
                if let Some(ms) = slo {
                    spec["slo"] = json!({ key: ms });
                }
                agree(kind, &spec)?;
            }
        }
    }
}

/// A rule's `fieldPath` must name a field below the rule's node, or the API server rejects the
/// CRD.
#[test]
fn field_paths_name_existing_fields() {
    let mut checked = 0;
    for kind in Kind::ALL {
        let schema = crd_support::schema(kind);
        for r in crd_support::rules(&schema) {
            let Some(fp) = &r.field_path else { continue };
            let mut node = &schema;
            for seg in r.path.split('.').filter(|s| !s.is_empty()) {
                node = &node["properties"][seg];
            }
            let rel = fp.strip_prefix('.').expect("fieldPath starts with a dot");
            for seg in rel.split('.') {
                node = &node["properties"][seg];
            }
            assert!(
                node.is_object(),
                "{} {}: fieldPath {fp} names no field",
                kind.name(),
                r.path
            );
            checked += 1;
        }
    }
    assert!(checked >= 10, "only {checked} rules have a fieldPath");
}
