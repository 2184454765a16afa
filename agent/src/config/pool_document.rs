//! The operator's pool document (the KVCachePool ConfigMap's `config.yaml`, selected with
//! `--pool-config`): parsed into [`PoolDocument`] and mapped to the agent's file config, so
//! that flags still override what it sets. I/O boundary: [`load_pool_document`] reads the
//! document and the node's meminfo; the rest is pure.

use std::path::{Path, PathBuf};

use bytesize::ByteSize;
use serde::Deserialize;

use super::{ConfigError, FileConfig, invalid};
use crate::placement::NumaPolicy;

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
    /// The operator's agent credential issuer, when it runs one.
    pub credential_issuer: Option<IssuerHead>,
    pub effective: kvpool_crd::ValidatedKVCachePool,
}

/// The pool document's `credentialIssuer`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IssuerHead {
    pub url: String,
    pub ca_pem: String,
    pub token_file: PathBuf,
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
    #[serde(default)]
    credential_issuer: Option<IssuerHead>,
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
        credential_issuer: head.credential_issuer,
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
    if let Some(p) = &eff.dram.persistence {
        // The operator mounts the host paths at the same paths in the agent.
        file.dram.persistence = Some(super::PersistenceSection {
            mode: Some(p.mode),
            path: Some(PathBuf::from(&p.host_path)),
            index_path: Some(PathBuf::from(&p.index_host_path)),
        });
    }
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
    match &doc.credential_issuer {
        // The operator issues each agent its node's credential; no key file is mounted.
        Some(i) => {
            file.pool.credential_issuer = Some(super::pool::IssuerSection {
                url: i.url.clone(),
                ca_pem: i.ca_pem.clone(),
                token_file: i.token_file.clone(),
                namespace: doc.namespace.clone(),
                pool: doc.pool.clone(),
            });
        }
        None => file.pool.auth_key_file = Some(doc.auth_key_file.clone()),
    }
    file.pool.transport_listen = Some(format!("0.0.0.0:{}", eff.transport.port));
    file.pool.replicas = Some(eff.replication.replicas);
    // The node's value of the spread label is its failure domain; the node also gets the
    // topology labels.
    file.kubernetes.failure_domain_label = Some(eff.replication.spread_label_key.clone());
    file.kubernetes.publish_topology = Some(true);
    file.pool.transport = Some(
        match eff.transport.protocol {
            kvpool_crd::Protocol::Auto => "auto",
            kvpool_crd::Protocol::Rdma => "rdma",
            kvpool_crd::Protocol::Tcp => "tcp",
        }
        .to_owned(),
    );
    file.pool.rdma_devices = eff.transport.devices.clone();
    file.pool.gid_index = eff.transport.gid_index;
    file.pool.transport_integrity = Some(eff.transport.integrity.as_str().to_owned());
    if let Some(tls) = &eff.transport.tls {
        // The operator mounts the Secret's items at TRANSFER_TLS_DIR in agent pods.
        let item = |name: &str| Some(Path::new(kvpool_crd::TRANSFER_TLS_DIR).join(name));
        file.pool.transport_tls = Some(tls.mode.as_str().to_owned());
        file.pool.transport_tls_cert_file = item("tls.crt");
        file.pool.transport_tls_key_file = item("tls.key");
        file.pool.transport_tls_ca_file = item("ca.crt");
        file.pool.transport_tls_server_name = Some(tls.server_name_for(&doc.pool, &doc.namespace));
    }
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
