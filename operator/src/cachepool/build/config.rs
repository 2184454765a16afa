//! The pool's ConfigMap: `config.yaml`, the effective settings the agent, master and conductor
//! read, and `engine.json`, what kvpool's adapters inside vLLM or SGLang need to reach the pool;
//! and the hash of that data which rolls every pod that mounts it when it changes.
//! I/O boundary: none.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use kvpool_crd::{Protocol, ValidatedKVCachePool};
use serde::Serialize;

use super::meta;
use crate::cachepool::validate::ValidCachePool;
use crate::contract;
use crate::error::{Error, Result};
use crate::labels::{self, Component};

/// The document written to `config.yaml`, read by the agent, master and conductor: the pool's
/// identity and addresses, followed by the effective settings (`kvpool_crd::ValidatedKVCachePool`,
/// flattened, so a reader that only knows that type can read the file as it is).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolConfig<'a> {
    pub pool: &'a str,
    pub namespace: &'a str,
    pub master_addr: String,
    pub auth_key_file: String,
    pub agent_socket: String,
    /// Where the agents get their node's credential, when the operator issues them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credential_issuer: Option<CredentialIssuer<'a>>,
    #[serde(flatten)]
    pub effective: &'a ValidatedKVCachePool,
}

/// The pool's config document.
/// The pool document's `credentialIssuer`: the issuer's URL, the CA that signs its
/// certificate, and the agent's projected token file.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CredentialIssuer<'a> {
    pub url: &'a str,
    pub ca_pem: &'a str,
    pub token_file: String,
}

pub fn pool_config(pool: &ValidCachePool) -> PoolConfig<'_> {
    PoolConfig {
        pool: &pool.name,
        namespace: &pool.namespace,
        master_addr: pool.master_addr(),
        auth_key_file: contract::auth_key_path(),
        agent_socket: contract::agent_socket_path(),
        credential_issuer: pool.agent_issuer.as_ref().map(|i| CredentialIssuer {
            url: &i.url,
            ca_pem: &i.ca_pem,
            token_file: format!(
                "{}/{}",
                contract::AGENT_TOKEN_DIR,
                contract::AGENT_TOKEN_FILE
            ),
        }),
        effective: &pool.effective,
    }
}

fn protocol_str(p: Protocol) -> &'static str {
    match p {
        Protocol::Auto => "auto",
        Protocol::Rdma => "rdma",
        Protocol::Tcp => "tcp",
    }
}

/// The engine-facing JSON config (`engine.json`): what the `kvpool` Python package's clients and
/// adapters inside vLLM or SGLang need to reach the pool. Keys follow Mooncake's store config
/// file where they overlap (`master_server_address`, `metadata_server`, `protocol`,
/// `device_name`), so Mooncake-style code reads it as it is. `master_server_address` is a
/// comma-separated list of master addresses; the operator writes the one it has, the master
/// Service, which reaches every replica (with HA, a standby answers with the leader's address
/// and the client follows it).
pub fn engine_config(pool: &ValidCachePool) -> serde_json::Value {
    let transport = &pool.effective.transport;
    serde_json::json!({
        "pool": pool.name,
        "master_server_address": pool.master_addr(),
        "metadata_server": "P2PHANDSHAKE",
        "protocol": match transport.protocol {
            Protocol::Tcp => "tcp",
            Protocol::Rdma | Protocol::Auto => "rdma",
        },
        "kvpool_protocol": protocol_str(transport.protocol),
        "device_name": transport.devices.join(","),
        "agent_socket": contract::agent_socket_path(),
        "block_size_tokens": pool.effective.block_size_tokens,
        "auth_key_file": contract::auth_key_path(),
        "replicas": pool.effective.replication.replicas,
    })
}

/// Render the ConfigMap data: `config.yaml` and `engine.json`.
pub fn config_data(pool: &ValidCachePool) -> Result<BTreeMap<String, String>> {
    let yaml = serde_saphyr::to_string(&pool_config(pool)).map_err(Error::RenderConfig)?;
    let json =
        serde_json::to_string_pretty(&engine_config(pool)).map_err(|source| Error::Serialize {
            what: "engine config",
            source,
        })?;
    Ok(BTreeMap::from([
        (contract::CONFIG_FILE_KEY.to_owned(), yaml),
        (contract::ENGINE_CONFIG_KEY.to_owned(), json),
    ]))
}

/// Hash of the ConfigMap data, for the pod-template annotation that rolls pods on change.
pub fn config_hash(data: &BTreeMap<String, String>) -> String {
    let mut buf = Vec::new();
    for (k, v) in data {
        buf.extend_from_slice(k.as_bytes());
        buf.push(0);
        buf.extend_from_slice(v.as_bytes());
        buf.push(0);
    }
    labels::content_hash(&buf)
}

/// The ConfigMap holding `data` (from [`config_data`]).
pub(super) fn config_map(pool: &ValidCachePool, data: BTreeMap<String, String>) -> ConfigMap {
    ConfigMap {
        metadata: meta(pool, Component::Config),
        data: Some(data),
        ..ConfigMap::default()
    }
}
