//! The `pool:` section of the agent's configuration: which master to join, with which key,
//! where the transfer engine listens and what it announces, heartbeat and task settings, and
//! the transport; validated into [`PoolConfig`] (absent `master`: local-only mode, `None`).
//! I/O boundary: none (pure).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{ConfigError, between, duration_at_least, invalid, socket_addr};

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
    /// This node's failure domain (rack, zone...), announced with its segments: the master
    /// keeps the replicas of a block in distinct domains when it spreads by failure domain.
    /// Wins over `kubernetes.failure_domain_label`.
    pub failure_domain: Option<String>,
    /// Transfer engine: `tcp` (default), `rdma` or `auto` (the KVCachePool's
    /// `transport.protocol`). With `rdma`/`auto` the engine opens the host's RDMA devices and
    /// falls back to TCP loudly when none works; the heartbeat reports it.
    pub transport: Option<String>,
    /// RDMA devices the transfer engine may use (the KVCachePool's `transport.devices`);
    /// empty: every device it finds (the pod's SR-IOV VFs when it has any).
    pub rdma_devices: Vec<String>,
    /// GID index every RDMA port sends from (`transport.gidIndex`); unset: automatic choice.
    pub gid_index: Option<u32>,
    /// Per-frame integrity of the transfer engine's TCP lanes (docs/transfer.md "Per-frame
    /// integrity"): `off`, `allow` (default: granted to initiators that ask) or `require`
    /// (every lane sealed both ways; initiators that do not ask are refused).
    pub transport_integrity: Option<String>,
    /// TLS on the transfer engine's TCP connections (docs/transfer.md "TLS"): `off`
    /// (default), `allow` (TLS and plaintext initiators served; lanes dial plaintext) or
    /// `require` (plaintext initiators refused; lanes dial TLS and verify targets against
    /// `transport_tls_ca_file`). `allow` and `require` need the certificate and key files.
    pub transport_tls: Option<String>,
    /// This agent's transfer certificate chain (PEM, leaf first).
    pub transport_tls_cert_file: Option<PathBuf>,
    /// Its private key (PEM).
    pub transport_tls_key_file: Option<PathBuf>,
    /// CA certificates (PEM) that verify other agents (needed by `require`).
    pub transport_tls_ca_file: Option<PathBuf>,
    /// Name every target certificate must carry; unset: the target's IP address.
    pub transport_tls_server_name: Option<String>,
    /// Hand the DRAM segments to engines on this node as shared memory (default true): the
    /// segments are memfds, served on `pool-shm.sock` in `engine_api.socket_dir`, and
    /// announced with a `shm://` endpoint beside the TCP one; an engine's pool client that can
    /// reach the socket copies to and from the segment's pages instead of going through TCP
    /// (docs/transfer.md "Same-node shared memory in pool mode").
    pub same_node_shm: Option<bool>,
    /// Get this node's credential from the operator's agent credential issuer instead of
    /// `auth_key_file` (the operator's pool document sets it).
    pub credential_issuer: Option<IssuerSection>,
}

/// `pool.credential_issuer`: the operator's agent credential issuer.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct IssuerSection {
    /// `https://host:port` of the issuer.
    pub url: String,
    /// CA certificate(s), PEM, that sign the issuer's certificate.
    pub ca_pem: String,
    /// The pod's projected ServiceAccount token.
    pub token_file: PathBuf,
    /// The pool's namespace and name.
    pub namespace: String,
    pub pool: String,
}

/// Validated pool membership.
#[derive(Clone, Debug)]
pub struct PoolConfig {
    pub masters: Vec<String>,
    /// The credential file; unused (empty) when `credential_issuer` is set.
    pub auth_key_file: PathBuf,
    /// Where this node's credential comes from instead of `auth_key_file`.
    pub credential_issuer: Option<crate::issuer::IssuerConfig>,
    /// TLS to the master: not in the file; `kvpool agent run`'s `--master-*` flags (or their
    /// `KVPOOL_MASTER_*` variables) set it after validation. Default: plaintext.
    pub master_tls: kvpool_client::master::MasterTls,
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
    /// RDMA device allow-list (empty: all).
    pub rdma_devices: Vec<String>,
    /// GID index override.
    pub gid_index: Option<u32>,
    /// `pool.failure_domain`, when given.
    pub failure_domain: Option<String>,
    /// `pool.transport_integrity`.
    pub integrity: kvpool_transfer::Integrity,
    /// `pool.transport_tls*`.
    pub tls: kvpool_transfer::TransferTls,
    /// Where the DRAM segments are shared with same-node engines (`pool.same_node_shm`);
    /// `None`: not shared.
    pub shm: Option<ShmShare>,
}

/// The Unix socket pool mode shares its DRAM segments on with engines of the same node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmShare {
    /// `pool-shm.sock` in `engine_api.socket_dir`.
    pub socket: PathBuf,
    /// The group it is handed to with mode 0660 (`engine_api.client_group`).
    pub group: Option<u32>,
}

/// Validate the `pool:` section; `None` when it names no master.
pub(super) fn validate(p: &PoolSection) -> Result<Option<PoolConfig>, ConfigError> {
    if p.master.is_empty() {
        return Ok(None);
    }
    if p.master.iter().any(|m| m.trim().is_empty()) {
        return Err(invalid("pool.master", "empty address"));
    }
    let credential_issuer = p.credential_issuer.as_ref().map(issuer).transpose()?;
    let auth_key_file = match (&p.auth_key_file, &credential_issuer) {
        (Some(f), _) => f.clone(),
        (None, Some(_)) => PathBuf::new(),
        (None, None) => {
            return Err(invalid(
                "pool.auth_key_file",
                "required when pool.master is set (or pool.credential_issuer)",
            ));
        }
    };
    let transport_listen = socket_addr(
        "pool.transport_listen",
        p.transport_listen.as_deref().unwrap_or("0.0.0.0:12345"),
    )?;
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
    let heartbeat_interval = duration_at_least(
        "pool.heartbeat_interval",
        p.heartbeat_interval.as_ref(),
        Duration::from_secs(1),
        Duration::from_millis(10),
    )?;
    let replicas = between("pool.replicas", p.replicas.unwrap_or(1), 1..=8)?;
    let max_tasks = between("pool.max_tasks", p.max_tasks.unwrap_or(4), 1..=256)?;
    let task_timeout = duration_at_least(
        "pool.task_timeout",
        p.task_timeout.as_ref(),
        Duration::from_secs(30),
        Duration::from_millis(100),
    )?;
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
    if let Some(d) = p.rdma_devices.iter().find(|d| {
        d.trim().is_empty() || d.len() > 64 || d.chars().any(|c| c.is_whitespace() || c == '/')
    }) {
        return Err(invalid(
            "pool.rdma_devices",
            format!("{d:?} is not an RDMA device name"),
        ));
    }
    let gid_index = match p.gid_index {
        Some(g) if g > kvpool_transfer::MAX_GID_INDEX => {
            return Err(invalid(
                "pool.gid_index",
                format!("{g} is above {}", kvpool_transfer::MAX_GID_INDEX),
            ));
        }
        g => g,
    };
    if !want_rdma && (gid_index.is_some() || !p.rdma_devices.is_empty()) {
        return Err(invalid(
            "pool.transport",
            "pool.rdma_devices and pool.gid_index require transport rdma or auto",
        ));
    }
    let integrity = match p.transport_integrity.as_deref().map(str::trim) {
        None | Some("allow") => kvpool_transfer::Integrity::Allow,
        Some("off") => kvpool_transfer::Integrity::Off,
        Some("require") => kvpool_transfer::Integrity::Require,
        Some(other) => {
            return Err(invalid(
                "pool.transport_integrity",
                format!("{other:?} is not one of off, allow, require"),
            ));
        }
    };
    let tls = transport_tls(p)?;
    let failure_domain = match p.failure_domain.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(d) => Some(label_value("pool.failure_domain", d)?.to_owned()),
    };
    Ok(Some(PoolConfig {
        masters: p.master.clone(),
        auth_key_file,
        credential_issuer,
        master_tls: kvpool_client::master::MasterTls::default(),
        transport_listen,
        advertise_host,
        heartbeat_interval,
        replicas,
        max_tasks,
        task_timeout,
        want_rdma,
        require_rdma,
        rdma_devices: p.rdma_devices.clone(),
        gid_index,
        failure_domain,
        integrity,
        tls,
        // Set by the caller, who knows the socket directory.
        shm: None,
    }))
}

/// `pool.credential_issuer`, checked: an https URL, a CA, a token file, the pool's identity.
fn issuer(s: &IssuerSection) -> Result<crate::issuer::IssuerConfig, ConfigError> {
    if !s.url.starts_with("https://") {
        return Err(invalid(
            "pool.credential_issuer.url",
            "must be an https:// URL",
        ));
    }
    if !s.ca_pem.contains("-----BEGIN CERTIFICATE-----") {
        return Err(invalid(
            "pool.credential_issuer.ca_pem",
            "holds no PEM certificate",
        ));
    }
    if s.token_file.as_os_str().is_empty() {
        return Err(invalid(
            "pool.credential_issuer.token_file",
            "must not be empty",
        ));
    }
    if s.namespace.is_empty() || s.pool.is_empty() {
        return Err(invalid(
            "pool.credential_issuer",
            "namespace and pool must name the KVCachePool",
        ));
    }
    Ok(crate::issuer::IssuerConfig {
        url: s.url.clone(),
        ca_pem: s.ca_pem.clone(),
        token_file: s.token_file.clone(),
        namespace: s.namespace.clone(),
        pool: s.pool.clone(),
    })
}

/// `pool.transport_tls*`: the mode and the files it needs (their contents are checked when
/// the transfer engine starts).
fn transport_tls(p: &PoolSection) -> Result<kvpool_transfer::TransferTls, ConfigError> {
    use kvpool_transfer::TlsMode;
    let mode = match p.transport_tls.as_deref().map(str::trim) {
        None | Some("off") => TlsMode::Off,
        Some("allow") => TlsMode::Allow,
        Some("require") => TlsMode::Require,
        Some(other) => {
            return Err(invalid(
                "pool.transport_tls",
                format!("{other:?} is not one of off, allow, require"),
            ));
        }
    };
    if mode != TlsMode::Off {
        if p.transport_tls_cert_file.is_none() || p.transport_tls_key_file.is_none() {
            return Err(invalid(
                "pool.transport_tls_cert_file",
                "transport_tls allow/require needs transport_tls_cert_file and \
                 transport_tls_key_file (this agent serves over TLS)",
            ));
        }
        if mode == TlsMode::Require && p.transport_tls_ca_file.is_none() {
            return Err(invalid(
                "pool.transport_tls_ca_file",
                "transport_tls require needs transport_tls_ca_file (the CA that verifies \
                 other agents)",
            ));
        }
    }
    Ok(kvpool_transfer::TransferTls {
        mode,
        cert_file: p.transport_tls_cert_file.clone(),
        key_file: p.transport_tls_key_file.clone(),
        ca_file: p.transport_tls_ca_file.clone(),
        server_name: p
            .transport_tls_server_name
            .as_deref()
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_owned),
    })
}

/// `value` of `field` when it is a Kubernetes label value (a failure domain is one in a
/// cluster): 1-63 alphanumerics, `-`, `_` and `.`, starting and ending with an alphanumeric.
pub(super) fn label_value<'a>(field: &'static str, value: &'a str) -> Result<&'a str, ConfigError> {
    let alnum = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_alphanumeric());
    let ok = (1..=63).contains(&value.len())
        && alnum(value.bytes().next())
        && alnum(value.bytes().last())
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if !ok {
        return Err(invalid(
            field,
            format!(
                "{value:?} is not a label value (1-63 alphanumerics, '-', '_', '.', \
                 starting and ending with an alphanumeric)"
            ),
        ));
    }
    Ok(value)
}
