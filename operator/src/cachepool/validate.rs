//! Validation of a `KVCachePool`: checks what the CRD's CEL rules check (an API server may not
//! enforce them, e.g. objects stored before a rule existed) plus what only the operator knows,
//! and resolves defaults into a [`ValidCachePool`] that `build` consumes.
//! I/O boundary: none.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{Resource, ResourceExt};
use kvpool::crd::{Hugepages, KVCachePool, KVCachePoolSpec, Protocol};

use crate::context::Settings;
use crate::error::{Error, Result};
use crate::labels::MAX_OWNER_NAME_LEN;
use kvpool::crd::quantity;

/// How much DRAM each node lends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DramCapacity {
    /// An explicit byte count per node.
    Bytes(u64),
    /// A share of the node's memory, in percent.
    NodePercent(i32),
}

/// A `KVCachePool` that passed validation, with defaults resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidCachePool {
    pub name: String,
    pub namespace: String,
    pub generation: Option<i64>,
    pub owner: OwnerReference,
    pub spec: KVCachePoolSpec,
    pub dram: DramCapacity,
    pub ssd_bytes: Option<u64>,
    pub agent_image: String,
    pub master_image: String,
    pub conductor_image: String,
}

impl ValidCachePool {
    /// `host:port` of the master Service inside the cluster.
    pub fn master_addr(&self) -> String {
        master_addr(&self.name, &self.namespace)
    }
}

/// `host:port` of a pool's master Service.
pub fn master_addr(pool: &str, namespace: &str) -> String {
    format!(
        "{}.{namespace}.svc:{}",
        crate::labels::child_name(pool, crate::labels::Component::Master),
        crate::contract::MASTER_PORT
    )
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidSpec(msg.into())
}

/// Validate `pool` and resolve its defaults with the operator `settings`.
pub fn validate(pool: &KVCachePool, settings: &Settings) -> Result<ValidCachePool> {
    let name = pool
        .metadata
        .name
        .clone()
        .ok_or(Error::MissingObjectKey("name"))?;
    let namespace = pool
        .namespace()
        .ok_or(Error::MissingObjectKey("namespace"))?;
    let owner = pool
        .controller_owner_ref(&())
        .ok_or(Error::MissingObjectKey("uid"))?;
    validate_name(&name)?;
    let spec = &pool.spec;

    if spec.block_size_tokens < 1 {
        return Err(invalid(format!(
            "spec.blockSizeTokens must be at least 1, got {}",
            spec.block_size_tokens
        )));
    }

    let dram = match (&spec.dram.capacity_per_node, spec.dram.node_memory_percent) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "spec.dram: set at most one of capacityPerNode and nodeMemoryPercent",
            ));
        }
        (Some(q), None) => {
            let bytes = quantity::parse_bytes(q)
                .map_err(|e| invalid(format!("spec.dram.capacityPerNode: {e}")))?;
            if bytes == 0 {
                return Err(invalid("spec.dram.capacityPerNode must be positive"));
            }
            DramCapacity::Bytes(bytes)
        }
        (None, Some(p)) if !(1..=100).contains(&p) => {
            return Err(invalid(format!(
                "spec.dram.nodeMemoryPercent must be within 1..=100, got {p}"
            )));
        }
        (None, Some(p)) => DramCapacity::NodePercent(p),
        (None, None) => DramCapacity::NodePercent(kvpool::crd::defaults::NODE_MEMORY_PERCENT),
    };
    if spec.dram.hugepages != Hugepages::None && !matches!(dram, DramCapacity::Bytes(_)) {
        return Err(invalid(
            "spec.dram.hugepages requires spec.dram.capacityPerNode: hugepage memory is reserved as an explicit amount",
        ));
    }

    let ssd_bytes = match &spec.ssd {
        None => None,
        Some(ssd) => {
            if !ssd.host_path.starts_with('/') || ssd.host_path.len() < 2 {
                return Err(invalid(format!(
                    "spec.ssd.hostPath must be an absolute directory other than /, got {:?}",
                    ssd.host_path
                )));
            }
            let bytes = quantity::parse_bytes(&ssd.capacity_per_node)
                .map_err(|e| invalid(format!("spec.ssd.capacityPerNode: {e}")))?;
            if bytes == 0 {
                return Err(invalid("spec.ssd.capacityPerNode must be positive"));
            }
            Some(bytes)
        }
    };

    let transport = &spec.transport;
    if transport.protocol == Protocol::Tcp {
        if transport.sriov.is_some() {
            return Err(invalid(
                "spec.transport.sriov requires spec.transport.protocol rdma or auto",
            ));
        }
        if !transport.networks.is_empty() {
            return Err(invalid(
                "spec.transport.networks (Multus) requires spec.transport.protocol rdma or auto",
            ));
        }
        if !transport.devices.is_empty() {
            return Err(invalid(
                "spec.transport.devices lists RDMA devices and requires spec.transport.protocol rdma or auto",
            ));
        }
    }
    if let Some(sriov) = &transport.sriov
        && sriov.count < 1
    {
        return Err(invalid(format!(
            "spec.transport.sriov.count must be at least 1, got {}",
            sriov.count
        )));
    }
    if !(1024..=65535).contains(&transport.port) {
        return Err(invalid(format!(
            "spec.transport.port must be within 1024..=65535, got {}",
            transport.port
        )));
    }

    let eviction = &spec.eviction;
    if eviction.low_watermark_percent >= eviction.high_watermark_percent
        || eviction.high_watermark_percent > 100
        || eviction.low_watermark_percent < 0
    {
        return Err(invalid(format!(
            "spec.eviction: need 0 <= lowWatermarkPercent < highWatermarkPercent <= 100, got {} and {}",
            eviction.low_watermark_percent, eviction.high_watermark_percent
        )));
    }
    if !(1..=8).contains(&spec.replication.replicas) {
        return Err(invalid(format!(
            "spec.replication.replicas must be within 1..=8, got {}",
            spec.replication.replicas
        )));
    }
    if spec.master.replicas < 1 {
        return Err(invalid("spec.master.replicas must be at least 1"));
    }
    if spec.master.replicas > 1 && spec.master.etcd_endpoints.is_empty() {
        return Err(invalid(
            "spec.master.replicas above 1 requires spec.master.etcdEndpoints (HA state lives in etcd)",
        ));
    }
    if spec.conductor.enabled && spec.conductor.replicas < 1 {
        return Err(invalid("spec.conductor.replicas must be at least 1"));
    }
    let slo = &spec.conductor.slo;
    if slo.ttft_millis < 1 || slo.tpot_millis < 1 {
        return Err(invalid(
            "spec.conductor.slo: ttftMillis and tpotMillis must be positive",
        ));
    }

    Ok(ValidCachePool {
        name,
        namespace,
        generation: pool.metadata.generation,
        owner,
        spec: spec.clone(),
        dram,
        ssd_bytes,
        agent_image: spec
            .agent
            .image
            .clone()
            .unwrap_or_else(|| settings.agent_image.clone()),
        master_image: spec
            .master
            .image
            .clone()
            .unwrap_or_else(|| settings.master_image.clone()),
        conductor_image: spec
            .conductor
            .image
            .clone()
            .unwrap_or_else(|| settings.conductor_image.clone()),
    })
}

/// Names must leave room for the longest child suffix within a DNS label.
pub fn validate_name(name: &str) -> Result<()> {
    if name.len() > MAX_OWNER_NAME_LEN {
        return Err(invalid(format!(
            "metadata.name must be at most {MAX_OWNER_NAME_LEN} characters so that child names fit in 63, got {}",
            name.len()
        )));
    }
    if name.contains('.') {
        return Err(invalid(format!(
            "metadata.name {name:?} must not contain '.': it names Services, which are DNS labels"
        )));
    }
    Ok(())
}
