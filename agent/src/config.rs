//! Agent configuration: a YAML file (serde-saphyr) overlaid with command-line flags, validated
//! once into [`AgentConfig`] with typed sizes and durations. A bad value is a [`ConfigError`]
//! naming the field. I/O boundary: reading the config file; validation is pure.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytesize::ByteSize;
use serde::{Deserialize, Serialize};

use crate::api::server::ApiLimits;
use crate::discovery::Roots;
use crate::placement::NumaPolicy;
use crate::ssd::{DirectIo, SsdConfig};

/// Errors of configuration.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum ConfigError {
    #[error("cannot read config file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path} is not valid: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<serde_saphyr::Error>,
    },
    #[error("invalid value for {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
}

impl ConfigError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        reason: reason.into(),
    }
}

/// The config file as written (every field optional; flags override it).
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct FileConfig {
    pub node_name: Option<String>,
    pub discovery: DiscoverySection,
    pub dram: DramSection,
    pub ssd: SsdSection,
    pub engine_api: ApiSection,
    pub admin: AdminSection,
    pub pool: PoolSection,
}

/// `pool:` joining a pool's master. Without `master` the agent runs local-only.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolSection {
    /// Master addresses (`host:port` or URLs).
    pub master: Vec<String>,
    /// File with the pool's shared key (masters, agents and clients use the same).
    pub auth_key_file: Option<PathBuf>,
    /// Listen address of the transfer-engine TCP target.
    pub transport_listen: Option<String>,
    /// Host announced to peers when `transport_listen` is a wildcard address.
    pub advertise_host: Option<String>,
    /// Heartbeat period, e.g. `1s`.
    pub heartbeat_interval: Option<String>,
    /// Replicas of every block an engine puts through this agent (default 1).
    pub replicas: Option<u8>,
    /// Master tasks (repair, demotion) executed at once (default 4).
    pub max_tasks: Option<usize>,
    /// A task not finished in this time is reported failed, e.g. `30s`.
    pub task_timeout: Option<String>,
    /// Transfer engine: `tcp` (default), `rdma` or `auto` (the KVCachePool's
    /// `transport.protocol`). With `rdma`/`auto` the engine opens the host's RDMA devices and
    /// falls back to TCP loudly when none works; the heartbeat reports it.
    pub transport: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoverySection {
    pub sysfs_root: Option<PathBuf>,
    pub procfs_root: Option<PathBuf>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DramSection {
    pub capacity: Option<ByteSize>,
    /// `nic-local` (default), `interleave`, `none` (map without binding) or `nodes: [..]`.
    pub numa_policy: Option<NumaPolicy>,
    /// `none`, `2MiB` or `1GiB`.
    pub hugepages: Option<String>,
    pub lock: Option<bool>,
    pub max_segment: Option<ByteSize>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SsdSection {
    /// Directory of the SSD tier; absent: no SSD tier.
    pub path: Option<PathBuf>,
    pub capacity: Option<ByteSize>,
    pub direct_io: Option<DirectIo>,
    /// On shutdown, write DRAM blocks without an SSD copy to SSD so a restart keeps them.
    pub persist_dram_on_shutdown: Option<bool>,
    /// How often data and index are flushed (`1s`, `500ms`).
    pub sync_interval: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApiSection {
    pub socket_dir: Option<PathBuf>,
    /// Where staging files go; default: the socket directory.
    pub shm_dir: Option<PathBuf>,
    pub max_sessions: Option<usize>,
    pub max_staging_bytes: Option<ByteSize>,
    /// Sessions unused this long are closed (`10m`).
    pub session_idle_timeout: Option<String>,
    /// Group id that engines run with: the socket and staging files are handed to it with mode
    /// 0660, so engines need not run as the agent's user. Unset: the agent's own group.
    pub client_group: Option<u32>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminSection {
    pub listen: Option<String>,
}

/// Validated DRAM settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DramConfig {
    pub capacity: u64,
    pub policy: NumaPolicy,
    pub hugepage_size: Option<u64>,
    pub lock: bool,
    pub max_segment: u64,
}

/// Validated SSD settings.
#[derive(Clone, Debug)]
pub struct SsdSettings {
    pub tier: SsdConfig,
    pub persist_dram_on_shutdown: bool,
    pub sync_interval: Duration,
}

/// Validated engine API settings.
#[derive(Clone, Debug)]
pub struct ApiConfig {
    pub socket_dir: PathBuf,
    pub shm_dir: PathBuf,
    pub limits: ApiLimits,
    pub session_idle_timeout: Duration,
    /// Group the socket and staging files are handed to (`engine_api.client_group`).
    pub client_group: Option<u32>,
}

/// The effective, validated configuration.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub node_name: String,
    pub roots: Roots,
    pub dram: DramConfig,
    pub ssd: Option<SsdSettings>,
    pub api: ApiConfig,
    pub admin_listen: SocketAddr,
    /// Pool membership; `None` is local-only mode.
    pub pool: Option<PoolConfig>,
}

/// Validated pool membership.
#[derive(Clone, Debug)]
pub struct PoolConfig {
    pub masters: Vec<String>,
    pub auth_key_file: PathBuf,
    pub transport_listen: SocketAddr,
    /// Address put in the announced `tcp://ip:port` endpoints.
    pub advertise_host: std::net::IpAddr,
    pub heartbeat_interval: Duration,
    pub replicas: u8,
    pub max_tasks: usize,
    pub task_timeout: Duration,
    /// The transfer engine wants RDMA (`pool.transport` is `rdma` or `auto`).
    pub want_rdma: bool,
    /// RDMA only (`pool.transport: rdma`): without a usable RDMA device the agent still joins
    /// the pool over TCP, but is not ready.
    pub require_rdma: bool,
}

fn validate_pool(p: &PoolSection) -> Result<Option<PoolConfig>, ConfigError> {
    if p.master.is_empty() {
        return Ok(None);
    }
    if p.master.iter().any(|m| m.trim().is_empty()) {
        return Err(invalid("pool.master", "empty address"));
    }
    let auth_key_file = p
        .auth_key_file
        .clone()
        .ok_or_else(|| invalid("pool.auth_key_file", "required when pool.master is set"))?;
    let listen = p.transport_listen.as_deref().unwrap_or("0.0.0.0:12345");
    let transport_listen: SocketAddr = listen
        .parse()
        .map_err(|e| invalid("pool.transport_listen", format!("{listen:?}: {e}")))?;
    let advertise_host = match &p.advertise_host {
        Some(h) => h.trim().parse().map_err(|e| {
            invalid(
                "pool.advertise_host",
                format!("{h:?} is not an IP address: {e}"),
            )
        })?,
        None if transport_listen.ip().is_unspecified() => {
            return Err(invalid(
                "pool.advertise_host",
                "required when pool.transport_listen is a wildcard address",
            ));
        }
        None => transport_listen.ip(),
    };
    let heartbeat_interval = match &p.heartbeat_interval {
        None => Duration::from_secs(1),
        Some(text) => humantime::parse_duration(text)
            .map_err(|e| invalid("pool.heartbeat_interval", format!("{text:?}: {e}")))?,
    };
    if heartbeat_interval < Duration::from_millis(10) {
        return Err(invalid("pool.heartbeat_interval", "must be at least 10ms"));
    }
    let replicas = p.replicas.unwrap_or(1);
    if !(1..=8).contains(&replicas) {
        return Err(invalid("pool.replicas", "must be between 1 and 8"));
    }
    let max_tasks = p.max_tasks.unwrap_or(4);
    if !(1..=256).contains(&max_tasks) {
        return Err(invalid("pool.max_tasks", "must be between 1 and 256"));
    }
    let task_timeout = match &p.task_timeout {
        None => Duration::from_secs(30),
        Some(text) => humantime::parse_duration(text)
            .map_err(|e| invalid("pool.task_timeout", format!("{text:?}: {e}")))?,
    };
    if task_timeout < Duration::from_millis(100) {
        return Err(invalid("pool.task_timeout", "must be at least 100ms"));
    }
    let require_rdma = p.transport.as_deref().map(str::trim) == Some("rdma");
    let want_rdma = match p.transport.as_deref().map(str::trim) {
        None | Some("tcp") => false,
        Some("rdma" | "auto") => true,
        Some(other) => {
            return Err(invalid(
                "pool.transport",
                format!("{other:?} is not one of tcp, rdma, auto"),
            ));
        }
    };
    Ok(Some(PoolConfig {
        masters: p.master.clone(),
        auth_key_file,
        transport_listen,
        advertise_host,
        heartbeat_interval,
        replicas,
        max_tasks,
        task_timeout,
        want_rdma,
        require_rdma,
    }))
}

/// Read and parse a config file.
pub fn load_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse(&text, path)
}

/// Parse config text (`path` only names it in errors).
pub fn parse(text: &str, path: &Path) -> Result<FileConfig, ConfigError> {
    if text.trim().is_empty() {
        return Ok(FileConfig::default());
    }
    serde_saphyr::from_str(text).map_err(|source| ConfigError::Parse {
        path: path.to_owned(),
        source: Box::new(source),
    })
}

const MIN_DRAM: u64 = 64 * 1024;
const MIN_SSD: u64 = 1 << 20;
/// Largest DRAM segment one allocator can address (4 KiB units, u32 offsets), kept well below.
const MAX_SEGMENT: u64 = 1 << 40;

/// Validate a file config (already overlaid with flags) into an [`AgentConfig`].
pub fn validate(file: &FileConfig) -> Result<AgentConfig, ConfigError> {
    let node_name = match &file.node_name {
        Some(n) if n.trim().is_empty() => return Err(invalid("node_name", "must not be empty")),
        Some(n) => n.clone(),
        None => std::env::var("NODE_NAME")
            .ok()
            .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "localhost".to_owned()),
    };
    let defaults = Roots::default();
    let roots = Roots {
        sysfs: file.discovery.sysfs_root.clone().unwrap_or(defaults.sysfs),
        procfs: file
            .discovery
            .procfs_root
            .clone()
            .unwrap_or(defaults.procfs),
    };

    let capacity = file.dram.capacity.map_or(1 << 30, |b| b.as_u64());
    if capacity < MIN_DRAM {
        return Err(invalid(
            "dram.capacity",
            format!(
                "{} is below the minimum of {}",
                ByteSize(capacity),
                ByteSize(MIN_DRAM)
            ),
        ));
    }
    let max_segment = file.dram.max_segment.map_or(1 << 30, |b| b.as_u64());
    if !(crate::dram::UNIT..=MAX_SEGMENT).contains(&max_segment) {
        return Err(invalid(
            "dram.max_segment",
            format!(
                "must be between 4 KiB and 1 TiB, got {}",
                ByteSize(max_segment)
            ),
        ));
    }
    let hugepage_size = match file.dram.hugepages.as_deref().map(str::trim) {
        None | Some("none") | Some("off") | Some("") => None,
        Some(text) => {
            let size: ByteSize = text
                .parse()
                .map_err(|e| invalid("dram.hugepages", format!("{text:?}: {e}")))?;
            match size.as_u64() {
                s @ (0x20_0000 | 0x4000_0000) => Some(s),
                s => {
                    return Err(invalid(
                        "dram.hugepages",
                        format!(
                            "{} is not a huge page size (use none, 2MiB or 1GiB)",
                            ByteSize(s)
                        ),
                    ));
                }
            }
        }
    };
    let policy = file.dram.numa_policy.clone().unwrap_or_default();
    if policy == NumaPolicy::Nodes(Vec::new()) {
        return Err(invalid(
            "dram.numa_policy",
            "nodes: [] names no NUMA node (use none to leave placement to the kernel)",
        ));
    }
    let dram = DramConfig {
        capacity,
        policy,
        hugepage_size,
        lock: file.dram.lock.unwrap_or(true),
        max_segment,
    };

    let ssd = match &file.ssd.path {
        None => {
            if file.ssd.capacity.is_some() {
                return Err(invalid("ssd.path", "required when ssd.capacity is set"));
            }
            None
        }
        Some(dir) => {
            if !dir.is_absolute() {
                return Err(invalid(
                    "ssd.path",
                    format!("{} is not absolute", dir.display()),
                ));
            }
            let capacity = file
                .ssd
                .capacity
                .ok_or_else(|| invalid("ssd.capacity", "required when ssd.path is set"))?
                .as_u64();
            if capacity < MIN_SSD {
                return Err(invalid(
                    "ssd.capacity",
                    format!("{} is below the minimum of 1 MiB", ByteSize(capacity)),
                ));
            }
            let sync_interval = match &file.ssd.sync_interval {
                None => Duration::from_secs(1),
                Some(text) => humantime::parse_duration(text)
                    .map_err(|e| invalid("ssd.sync_interval", format!("{text:?}: {e}")))?,
            };
            if sync_interval.is_zero() {
                return Err(invalid("ssd.sync_interval", "must be positive"));
            }
            Some(SsdSettings {
                tier: SsdConfig {
                    dir: dir.clone(),
                    capacity,
                    direct_io: file.ssd.direct_io.unwrap_or_default(),
                },
                persist_dram_on_shutdown: file.ssd.persist_dram_on_shutdown.unwrap_or(false),
                sync_interval,
            })
        }
    };

    let socket_dir = file
        .engine_api
        .socket_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("/run/kvpool"));
    if !socket_dir.is_absolute() {
        return Err(invalid(
            "engine_api.socket_dir",
            format!("{} is not absolute", socket_dir.display()),
        ));
    }
    // sun_path holds 108 bytes including the terminator.
    let socket_len = socket_dir.join(crate::api::SOCKET_NAME).as_os_str().len();
    if socket_len > 107 {
        return Err(invalid(
            "engine_api.socket_dir",
            format!("socket path would be {socket_len} bytes; Unix sockets allow 107"),
        ));
    }
    let shm_dir = file
        .engine_api
        .shm_dir
        .clone()
        .unwrap_or_else(|| socket_dir.clone());
    let max_sessions = file.engine_api.max_sessions.unwrap_or(64);
    if max_sessions == 0 {
        return Err(invalid("engine_api.max_sessions", "must be at least 1"));
    }
    let max_staging_bytes = file
        .engine_api
        .max_staging_bytes
        .map_or(1 << 30, |b| b.as_u64());
    if max_staging_bytes < 4096 {
        return Err(invalid(
            "engine_api.max_staging_bytes",
            "must be at least 4 KiB",
        ));
    }
    let session_idle_timeout = match &file.engine_api.session_idle_timeout {
        None => Duration::from_secs(600),
        Some(text) => humantime::parse_duration(text)
            .map_err(|e| invalid("engine_api.session_idle_timeout", format!("{text:?}: {e}")))?,
    };
    if session_idle_timeout < Duration::from_secs(1) {
        return Err(invalid(
            "engine_api.session_idle_timeout",
            "must be at least 1s",
        ));
    }
    let listen = file.admin.listen.as_deref().unwrap_or("0.0.0.0:9464");
    let admin_listen: SocketAddr = listen
        .parse()
        .map_err(|e| invalid("admin.listen", format!("{listen:?}: {e}")))?;
    let pool = validate_pool(&file.pool)?;

    Ok(AgentConfig {
        node_name,
        roots,
        dram,
        ssd,
        api: ApiConfig {
            socket_dir,
            shm_dir,
            limits: ApiLimits {
                max_sessions,
                max_staging_bytes,
            },
            session_idle_timeout,
            client_group: file.engine_api.client_group,
        },
        admin_listen,
        pool,
    })
}

/// The pool document the operator writes to the ConfigMap's `config.yaml` (selected with
/// `--pool-config`): the pool's identity and addresses next to the effective settings, which
/// are `kvpool_crd::ValidatedKVCachePool` itself, so the CRD types stay the one definition.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolDocument {
    pub pool: String,
    pub namespace: String,
    /// `host:port` of the pool's master Service.
    pub master_addr: String,
    pub auth_key_file: PathBuf,
    /// Path of the agent's Unix socket (the engines connect there).
    pub agent_socket: PathBuf,
    pub effective: kvpool_crd::ValidatedKVCachePool,
}

/// The identity fields of the pool document; the rest is read as the CRD type.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PoolHead {
    pool: String,
    namespace: String,
    master_addr: String,
    auth_key_file: PathBuf,
    agent_socket: PathBuf,
}

/// Parse the operator's pool document (`path` only names it in errors).
pub fn parse_pool_document(text: &str, path: &Path) -> Result<PoolDocument, ConfigError> {
    let parse_err = |source| ConfigError::Parse {
        path: path.to_owned(),
        source: Box::new(source),
    };
    let head: PoolHead = serde_saphyr::from_str(text).map_err(parse_err)?;
    let effective = serde_saphyr::from_str(text).map_err(parse_err)?;
    Ok(PoolDocument {
        pool: head.pool,
        namespace: head.namespace,
        master_addr: head.master_addr,
        auth_key_file: head.auth_key_file,
        agent_socket: head.agent_socket,
        effective,
    })
}

/// The agent's file config for a pool document on a node with `node_memory_bytes` of memory
/// (used only when the pool sizes DRAM as a percentage). Pure.
pub fn from_pool_document(
    doc: &PoolDocument,
    node_memory_bytes: u64,
) -> Result<FileConfig, ConfigError> {
    use kvpool_crd::{Hugepages, NumaPolicy as CrdNuma};
    let eff = &doc.effective;
    let mut file = FileConfig::default();
    file.dram.capacity = Some(ByteSize(
        eff.dram.capacity.bytes_for_node(node_memory_bytes),
    ));
    file.dram.hugepages = Some(
        match eff.dram.hugepages {
            Hugepages::None => "none",
            Hugepages::Size2Mi => "2MiB",
            Hugepages::Size1Gi => "1GiB",
        }
        .to_owned(),
    );
    // `none` leaves placement to the kernel: the agent maps without binding.
    file.dram.numa_policy = Some(match eff.dram.numa_policy {
        CrdNuma::Local => NumaPolicy::NicLocal,
        CrdNuma::Interleave => NumaPolicy::Interleave,
        CrdNuma::None => NumaPolicy::None,
    });
    if let Some(ssd) = &eff.ssd {
        file.ssd.path = Some(PathBuf::from(&ssd.host_path));
        file.ssd.capacity = Some(ByteSize(ssd.capacity_bytes));
    }
    let socket_dir = doc
        .agent_socket
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .ok_or_else(|| {
            invalid(
                "agentSocket",
                format!("{} has no directory", doc.agent_socket.display()),
            )
        })?;
    if doc.agent_socket.file_name() != Some(std::ffi::OsStr::new(crate::api::SOCKET_NAME)) {
        return Err(invalid(
            "agentSocket",
            format!(
                "{} must be named {} (the agent's socket file name)",
                doc.agent_socket.display(),
                crate::api::SOCKET_NAME
            ),
        ));
    }
    file.engine_api.socket_dir = Some(socket_dir.to_owned());
    // Engine pods run as the images' non-root user with this fsGroup (operator).
    file.engine_api.client_group = Some(kvpool_crd::POOL_CLIENT_GROUP);
    if doc.master_addr.trim().is_empty() {
        return Err(invalid("masterAddr", "must not be empty"));
    }
    file.pool.master = vec![doc.master_addr.clone()];
    file.pool.auth_key_file = Some(doc.auth_key_file.clone());
    file.pool.transport_listen = Some(format!("0.0.0.0:{}", eff.transport.port));
    file.pool.replicas = Some(eff.replication.replicas);
    file.pool.transport = Some(
        match eff.transport.protocol {
            kvpool_crd::Protocol::Auto => "auto",
            kvpool_crd::Protocol::Rdma => "rdma",
            kvpool_crd::Protocol::Tcp => "tcp",
        }
        .to_owned(),
    );
    Ok(file)
}

/// Read the operator's pool document at `path` and map it to a file config, reading the node's
/// memory size from `<procfs_root>/meminfo` when DRAM is a percentage of it.
pub fn load_pool_document(path: &Path, procfs_root: &Path) -> Result<FileConfig, ConfigError> {
    let read = |p: &Path| {
        std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
            path: p.to_owned(),
            source,
        })
    };
    let doc = parse_pool_document(&read(path)?, path)?;
    let node_memory = match doc.effective.dram.capacity {
        kvpool_crd::DramCapacity::Bytes(_) => 0,
        kvpool_crd::DramCapacity::NodeMemoryPercent(_) => {
            let meminfo = procfs_root.join("meminfo");
            crate::discovery::parse_meminfo(&read(&meminfo)?)
                .get("MemTotal")
                .copied()
                .filter(|&b| b > 0)
                .ok_or_else(|| {
                    invalid(
                        "dram.nodeMemoryPercent",
                        format!("no MemTotal in {}", meminfo.display()),
                    )
                })?
        }
    };
    from_pool_document(&doc, node_memory)
}

#[cfg(test)]
mod tests {
    use super::*;

    const POOL_DOC: &str = "pool: p\nnamespace: ns\nmasterAddr: p-master.ns.svc:50051\n\
authKeyFile: /etc/kvpool/auth/key\nagentSocket: /run/kvpool/agent.sock\nblockSizeTokens: 256\n\
dram: {capacity: {nodeMemoryPercent: 50}, hugepages: 2Mi, numaPolicy: interleave}\n\
ssd: {hostPath: /mnt/nvme, capacityBytes: 1073741824}\n\
transport: {protocol: tcp, devices: [], sriov: null, networks: [], port: 15600}\n\
replication: {replicas: 2, spreadLabelKey: kubernetes.io/hostname}\n\
eviction: {highWatermarkPercent: 90, lowWatermarkPercent: 80, policy: lru}\n\
master: {replicas: 1, etcdEndpoints: []}\nconductor: null\n";

    #[test]
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
        let pool = cfg.pool.expect("pool mode");
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
        let pool = validate_yaml(
            "pool: {master: [m:1], auth_key_file: /k, transport_listen: 127.0.0.1:0}",
        )
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
}
