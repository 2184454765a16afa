//! The NUMA node of a PCI device (a GPU, a NIC) as sysfs reports it: the one reader that the
//! transfer engine (GPU segments, RDMA NICs) and the agent's topology discovery share.
//! I/O boundary: reading one `numa_node` file under a configurable sysfs root.

use std::io;
use std::path::{Path, PathBuf};

/// Why a device's `numa_node` file gave no answer. `-1` (the kernel's "no affinity") is not
/// an error: it reads as `None`.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum NumaNodeError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{}: not a NUMA node number: {text:?}", path.display())]
    NotANumber { path: PathBuf, text: String },
    #[error("{}: invalid NUMA node {value}", path.display())]
    OutOfRange { path: PathBuf, value: i64 },
}

impl NumaNodeError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }

    /// The file that was read.
    pub fn path(&self) -> &Path {
        match self {
            NumaNodeError::Read { path, .. }
            | NumaNodeError::NotANumber { path, .. }
            | NumaNodeError::OutOfRange { path, .. } => path,
        }
    }
}

/// Parse the contents of a `numa_node` file: a node number, or `-1` for none.
pub fn parse_numa_node(path: &Path, text: &str) -> Result<Option<u32>, NumaNodeError> {
    let text = text.trim();
    match text.parse::<i64>() {
        Ok(-1) => Ok(None),
        Ok(value) => u32::try_from(value)
            .map(Some)
            .map_err(|_| NumaNodeError::OutOfRange {
                path: path.to_owned(),
                value,
            }),
        Err(_) => Err(NumaNodeError::NotANumber {
            path: path.to_owned(),
            text: text.to_owned(),
        }),
    }
}

/// Read a `numa_node` file (`<device>/numa_node`, also reached through class links such as
/// `class/infiniband/<nic>/device/numa_node`).
pub fn numa_node_file(path: &Path) -> Result<Option<u32>, NumaNodeError> {
    let text = std::fs::read_to_string(path).map_err(|source| NumaNodeError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse_numa_node(path, &text)
}

/// The NUMA node of the PCI device `bdf` (`0000:18:00.0`, as `nvidia-smi` and the device
/// plugins print it; case does not matter), from `<sysfs_root>/bus/pci/devices/<bdf>/numa_node`.
pub fn pci_numa_node(sysfs_root: &Path, bdf: &str) -> Result<Option<u32>, NumaNodeError> {
    let path = sysfs_root
        .join("bus/pci/devices")
        .join(bdf.trim().to_ascii_lowercase())
        .join("numa_node");
    numa_node_file(&path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_numbers_minus_one_and_garbage() {
        let p = Path::new("x/numa_node");
        assert_eq!(parse_numa_node(p, "1\n").unwrap(), Some(1));
        assert_eq!(parse_numa_node(p, "-1").unwrap(), None);
        let e = parse_numa_node(p, "-2").unwrap_err();
        assert_eq!(e.to_string(), "x/numa_node: invalid NUMA node -2");
        let e = parse_numa_node(p, "node0").unwrap_err();
        assert_eq!(e.category(), "not_a_number");
        assert_eq!(e.path(), p);
        let e = pci_numa_node(Path::new("/nonexistent-sysfs"), "0000:00:00.0").unwrap_err();
        assert!(
            e.to_string().starts_with(
                "cannot read /nonexistent-sysfs/bus/pci/devices/0000:00:00.0/numa_node"
            ),
            "{e}"
        );
    }
}
