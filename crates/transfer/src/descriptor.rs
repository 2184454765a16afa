//! Segment descriptors and the directory that hands them out (the master in production, a static
//! table in tests and benchmarks). Pure data plus an in-memory directory; no I/O.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use parking_lot::RwLock;
use serde::{Deserialize, Serialize};

/// Transport protocols of the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// TCP lanes; always available.
    Tcp,
    /// Same-node shared memory (memfd passed over a Unix socket).
    Shm,
    /// RDMA (cargo feature `rdma`); its control connection is TCP.
    Rdma,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Shm => "shm",
            Protocol::Rdma => "rdma",
        }
    }
}

/// Where a segment's owner accepts connections.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    /// TCP listener (also the control connection of RDMA).
    Tcp(SocketAddr),
    /// Unix socket of the same-node shared-memory server.
    Shm(PathBuf),
}

/// Kind of memory behind a segment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryKind {
    #[default]
    Host,
    Gpu,
}

/// An RDMA NIC that can reach the segment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicDescriptor {
    /// Device name, e.g. `mlx5_0`.
    pub device: String,
    /// Port number (1-based).
    pub port: u8,
    /// GID index used for RoCE v2.
    pub gid_index: u32,
    /// NUMA node of the NIC, if known.
    pub numa_node: Option<u32>,
}

/// Everything a peer needs to open a segment: the directory's unit of exchange.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDescriptor {
    /// Pool-wide unique name.
    pub name: String,
    /// Node (Kubernetes node name, or hostname) that owns the memory.
    pub node: String,
    /// Size in bytes.
    pub size: u64,
    /// NUMA node of the memory, if known.
    #[serde(default)]
    pub numa_node: Option<u32>,
    #[serde(default)]
    pub memory: MemoryKind,
    /// The GPU (CUDA ordinal on its node) whose memory this is, for `memory: gpu`.
    #[serde(default)]
    pub gpu_device: Option<u32>,
    /// Endpoints, in the owner's order of preference.
    pub endpoints: Vec<Endpoint>,
    /// The owner's RDMA NICs that serve this segment: those on the memory's NUMA node (all of
    /// them when the node is unknown or has none). A peer's RDMA queue pairs to the segment
    /// end on these NICs. Empty without RDMA, and in descriptors the master rebuilds from
    /// replica records (see docs/transfer.md).
    #[serde(default)]
    pub nics: Vec<NicDescriptor>,
}

impl SegmentDescriptor {
    pub fn tcp_endpoint(&self) -> Option<SocketAddr> {
        self.endpoints.iter().find_map(|e| match e {
            Endpoint::Tcp(a) => Some(*a),
            Endpoint::Shm(_) => None,
        })
    }

    pub fn shm_endpoint(&self) -> Option<&PathBuf> {
        self.endpoints.iter().find_map(|e| match e {
            Endpoint::Shm(p) => Some(p),
            Endpoint::Tcp(_) => None,
        })
    }
}

/// Errors of directory lookups.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum DirectoryError {
    #[error("segment {0:?} is not in the directory")]
    NotFound(String),
    #[error("directory lookup of {name:?} failed: {reason}")]
    Unavailable { name: String, reason: String },
}

impl DirectoryError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// Resolves segment names to descriptors. The master implements it over its RPC API.
pub trait Directory: Send + Sync {
    fn lookup(&self, name: &str) -> Result<SegmentDescriptor, DirectoryError>;
}

/// A fixed, in-memory directory.
#[derive(Debug, Default)]
pub struct StaticDirectory {
    entries: RwLock<HashMap<String, SegmentDescriptor>>,
}

impl StaticDirectory {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add or replace a descriptor.
    pub fn insert(&self, desc: SegmentDescriptor) {
        self.entries.write().insert(desc.name.clone(), desc);
    }

    pub fn remove(&self, name: &str) -> Option<SegmentDescriptor> {
        self.entries.write().remove(name)
    }
}

impl FromIterator<SegmentDescriptor> for StaticDirectory {
    fn from_iter<T: IntoIterator<Item = SegmentDescriptor>>(iter: T) -> Self {
        let dir = StaticDirectory::new();
        for d in iter {
            dir.insert(d);
        }
        dir
    }
}

impl Directory for StaticDirectory {
    fn lookup(&self, name: &str) -> Result<SegmentDescriptor, DirectoryError> {
        self.entries
            .read()
            .get(name)
            .cloned()
            .ok_or_else(|| DirectoryError::NotFound(name.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip_through_json_and_the_static_directory() {
        let d = SegmentDescriptor {
            name: "node-a/dram0".into(),
            node: "node-a".into(),
            size: 1 << 30,
            numa_node: Some(1),
            memory: MemoryKind::Host,
            gpu_device: None,
            endpoints: vec![
                Endpoint::Tcp("10.0.0.1:7400".parse().unwrap()),
                Endpoint::Shm("/run/kvpool/transfer.sock".into()),
            ],
            nics: vec![],
        };
        let json = serde_json::to_string(&d).unwrap();
        assert!(json.contains(r#""tcp":"10.0.0.1:7400""#), "{json}");
        let back: SegmentDescriptor = serde_json::from_str(&json).unwrap();
        assert_eq!(back, d);
        let dir: StaticDirectory = [d.clone()].into_iter().collect();
        assert_eq!(dir.lookup("node-a/dram0").unwrap(), d);
        assert_eq!(d.tcp_endpoint(), Some("10.0.0.1:7400".parse().unwrap()));
        assert!(matches!(dir.lookup("x"), Err(DirectoryError::NotFound(_))));
        // Descriptors written before `gpu_device` and `nics` existed still parse.
        let old = r#"{"name":"n/g0","node":"n","size":4096,"memory":"gpu","endpoints":[]}"#;
        let old: SegmentDescriptor = serde_json::from_str(old).unwrap();
        assert_eq!(
            (old.memory, old.gpu_device, old.nics.len()),
            (MemoryKind::Gpu, None, 0)
        );
        let gpu = SegmentDescriptor {
            memory: MemoryKind::Gpu,
            gpu_device: Some(3),
            nics: vec![NicDescriptor {
                device: "mlx5_4".into(),
                port: 1,
                gid_index: 3,
                numa_node: Some(1),
            }],
            ..d
        };
        let back: SegmentDescriptor =
            serde_json::from_str(&serde_json::to_string(&gpu).unwrap()).unwrap();
        assert_eq!(back, gpu);
    }
}
