//! Agent configuration: a YAML file (serde-saphyr) overlaid with command-line flags, validated
//! once into [`AgentConfig`] with typed sizes and durations. A bad value is a [`ConfigError`]
//! naming the field. Pool membership (the `pool:` section) is validated in [`pool`], the use of
//! the node's Kubernetes object (`kubernetes:`) in [`kubernetes`]; the operator's pool document
//! is mapped to a file config in [`pool_document`]. I/O boundary:
//! reading the config file; validation is pure.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytesize::ByteSize;
use serde::{Deserialize, Serialize};

use crate::api::server::ApiLimits;
use crate::discovery::Roots;
use crate::placement::NumaPolicy;
use crate::ssd::{DirectIo, SsdConfig};

pub mod kubernetes;
pub mod pool;
pub mod pool_document;
#[cfg(test)]
mod tests;

pub use kubernetes::{KubernetesConfig, KubernetesSection};
/// Backing of the DRAM tier: the KVCachePool's own type (`none`, `tmpfs`, `hugetlbfs`).
pub use kvpool_crd::PersistenceMode;
pub use pool::{PoolConfig, PoolSection};
pub use pool_document::{
    PoolDocument, from_pool_document, load_pool_document, parse_pool_document,
};

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

kvpool_runtime::error_category!(ConfigError);

fn invalid(field: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        reason: reason.into(),
    }
}

/// `text` as a duration for `field`, `default` when absent.
fn duration(
    field: &'static str,
    text: Option<&String>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    match text {
        None => Ok(default),
        Some(text) => {
            humantime::parse_duration(text).map_err(|e| invalid(field, format!("{text:?}: {e}")))
        }
    }
}

/// [`duration`], refused below `min`.
fn duration_at_least(
    field: &'static str,
    text: Option<&String>,
    default: Duration,
    min: Duration,
) -> Result<Duration, ConfigError> {
    let d = duration(field, text, default)?;
    if d < min {
        return Err(invalid(
            field,
            format!("must be at least {}", humantime::format_duration(min)),
        ));
    }
    Ok(d)
}

/// `value` of `field`, refused outside `range`.
fn between<T: PartialOrd + std::fmt::Display>(
    field: &'static str,
    value: T,
    range: std::ops::RangeInclusive<T>,
) -> Result<T, ConfigError> {
    if !range.contains(&value) {
        return Err(invalid(
            field,
            format!("must be between {} and {}", range.start(), range.end()),
        ));
    }
    Ok(value)
}

/// `text` as a socket address for `field`.
fn socket_addr(field: &'static str, text: &str) -> Result<SocketAddr, ConfigError> {
    text.parse()
        .map_err(|e| invalid(field, format!("{text:?}: {e}")))
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
    pub kubernetes: KubernetesSection,
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
    /// Keep the tier in files that outlive the agent (pool mode): see [`PersistenceSection`].
    pub persistence: Option<PersistenceSection>,
}

/// Where a persistent DRAM tier lives: `mode: tmpfs` with `path` a directory on tmpfs (for
/// example `/dev/shm/kvpool`), or `mode: hugetlbfs` with `path` a directory on a hugetlbfs
/// mount and `index_path` a directory on tmpfs for the indexes (hugetlbfs files cannot be
/// written with `write`); `mode: none` (the default) keeps the tier in anonymous memory.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PersistenceSection {
    pub mode: Option<PersistenceMode>,
    pub path: Option<PathBuf>,
    pub index_path: Option<PathBuf>,
}

/// Validated persistent DRAM tier: segment `i` is `dir/dram<i>.dat`, its index
/// `index_dir/dram<i>.idx`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DramPersistence {
    pub mode: PersistenceMode,
    pub dir: PathBuf,
    pub index_dir: PathBuf,
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
    /// The tier kept in files that outlive the agent; `None`: anonymous memory.
    pub persistence: Option<DramPersistence>,
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
    /// What the agent reads from and writes to its Node object.
    pub kubernetes: KubernetesConfig,
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

/// An absolute directory for `field`.
fn absolute_dir(field: &'static str, path: Option<&PathBuf>) -> Result<PathBuf, ConfigError> {
    let dir = path.ok_or_else(|| invalid(field, "required with a persistent DRAM tier"))?;
    if !dir.is_absolute() {
        return Err(invalid(field, format!("{} is not absolute", dir.display())));
    }
    Ok(dir.clone())
}

/// Validate `dram.persistence`. The filesystem under the paths is checked at start-up.
fn persistence(
    section: Option<&PersistenceSection>,
) -> Result<Option<DramPersistence>, ConfigError> {
    let Some(p) = section else {
        return Ok(None);
    };
    let mode = p.mode.unwrap_or_default();
    match mode {
        PersistenceMode::None => Ok(None),
        PersistenceMode::Tmpfs => {
            let dir = absolute_dir("dram.persistence.path", p.path.as_ref())?;
            let index_dir = match &p.index_path {
                None => dir.clone(),
                Some(_) => absolute_dir("dram.persistence.index_path", p.index_path.as_ref())?,
            };
            Ok(Some(DramPersistence {
                mode,
                dir,
                index_dir,
            }))
        }
        PersistenceMode::Hugetlbfs => Ok(Some(DramPersistence {
            mode,
            dir: absolute_dir("dram.persistence.path", p.path.as_ref())?,
            index_dir: absolute_dir("dram.persistence.index_path", p.index_path.as_ref())?,
        })),
    }
}

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
        persistence: persistence(file.dram.persistence.as_ref())?,
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
            let sync_interval = duration(
                "ssd.sync_interval",
                file.ssd.sync_interval.as_ref(),
                Duration::from_secs(1),
            )?;
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
    let socket_len = [crate::api::SOCKET_NAME, crate::pool::SHM_SOCKET_NAME]
        .iter()
        .map(|name| socket_dir.join(name).as_os_str().len())
        .max()
        .unwrap_or(0);
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
    let session_idle_timeout = duration_at_least(
        "engine_api.session_idle_timeout",
        file.engine_api.session_idle_timeout.as_ref(),
        Duration::from_secs(600),
        Duration::from_secs(1),
    )?;
    let admin_listen = socket_addr(
        "admin.listen",
        file.admin.listen.as_deref().unwrap_or("0.0.0.0:9464"),
    )?;
    let mut pool = pool::validate(&file.pool)?;
    // Shared by default, except where every transfer must be TLS (`transport_tls: require`):
    // there only an explicit `same_node_shm: true` shares, since the socket's bytes bypass TLS.
    if let Some(p) = pool.as_mut()
        && file
            .pool
            .same_node_shm
            .unwrap_or(p.tls.mode != kvpool_transfer::TlsMode::Require)
    {
        p.shm = Some(pool::ShmShare {
            socket: socket_dir.join(crate::pool::SHM_SOCKET_NAME),
            group: file.engine_api.client_group,
        });
    }
    let kubernetes = kubernetes::validate(&file.kubernetes)?;
    let domain_configured = pool.as_ref().is_some_and(|p| p.failure_domain.is_some());
    kubernetes::check_support(&kubernetes, domain_configured)?;
    if dram.persistence.is_some() && pool.is_none() {
        return Err(invalid(
            "dram.persistence",
            "a persistent DRAM tier needs pool mode (pool.master): local-only mode keeps its \
             own allocator in process memory",
        ));
    }

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
        kubernetes,
    })
}
