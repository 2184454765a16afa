//! Which RDMA NICs an engine opens and which of them carries a transfer, from the node's
//! topology: the pool's allow-list (`transport.devices`), the SR-IOV VFs the device plugin gave
//! to the pod (`PCIDEVICE_<RESOURCE>` variables, mapped to RDMA devices by PCI address), a GID
//! index override (`transport.gidIndex`) and the NUMA node of each NIC and of the memory.
//! Pure: the devices come from `topology::scan`, the variables from the caller.

use std::collections::BTreeSet;

use super::topology::{self, NicChoice, RdmaDevice};

/// Prefix of the variables through which the SR-IOV device plugin names a pod's VFs
/// (`PCIDEVICE_NVIDIA_COM_MLX5_VF=0000:19:00.2,0000:9b:00.3`).
pub const DEVICE_PLUGIN_ENV_PREFIX: &str = "PCIDEVICE_";

/// What limits and orders the NICs an engine opens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NicPolicy {
    /// Device names the engine may use (`transport.devices`); empty: every device.
    pub allow: Vec<String>,
    /// PCI addresses of the SR-IOV VFs given to this pod. When any of them is an RDMA device,
    /// the engine uses those VFs only; without them it uses physical functions (a VF that the
    /// pod was not given belongs to another pod), unless the allow-list names a VF.
    pub pod_vfs: Vec<String>,
    /// GID index for every port instead of the automatic RoCE v2 choice.
    pub gid_index: Option<u32>,
    /// NUMA node of the memory (or GPU) this engine mostly moves: NICs on it come first.
    pub numa_node: Option<u32>,
}

/// Errors of NIC selection; the text names the setting that excluded the devices.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum SelectError {
    #[error(
        "transport.devices allows {allowed:?}, but this host has none of them (it has {found:?})"
    )]
    NotAllowed {
        allowed: Vec<String>,
        found: Vec<String>,
    },
    #[error("no usable RDMA NIC: {}", reasons.join("; "))]
    NoneUsable { reasons: Vec<String> },
}

impl SelectError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// The NICs to open, best first, and what was left out and why (to log as warnings).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    pub nics: Vec<NicChoice>,
    pub notes: Vec<String>,
}

/// PCI addresses named by the device plugin's variables in `vars` (name, value), in order, and
/// a note for every entry that is not a PCI address.
pub fn pod_vfs_from_env<I, K, V>(vars: I) -> (Vec<String>, Vec<String>)
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<str>,
    V: AsRef<str>,
{
    let mut vars: Vec<(String, String)> = vars
        .into_iter()
        .filter(|(k, _)| k.as_ref().starts_with(DEVICE_PLUGIN_ENV_PREFIX))
        .map(|(k, v)| (k.as_ref().to_owned(), v.as_ref().to_owned()))
        .collect();
    vars.sort();
    let mut out = Vec::new();
    let mut notes = Vec::new();
    for (var, value) in vars {
        for id in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if topology::is_pci_bus_id(id) {
                let id = id.to_ascii_lowercase();
                if !out.contains(&id) {
                    out.push(id);
                }
            } else {
                notes.push(format!("{var}: {id:?} is not a PCI address; ignored"));
            }
        }
    }
    (out, notes)
}

/// Choose the NICs to open under `policy`: allowed devices; the pod's VFs when it has any that
/// are RDMA devices, else physical functions (and VFs the allow-list names); active ports with a
/// usable GID (the override when set); NICs on `policy.numa_node` first, then by name.
pub fn select(devices: &[RdmaDevice], policy: &NicPolicy) -> Result<Selection, SelectError> {
    let mut notes = Vec::new();
    let named: BTreeSet<&str> = policy.allow.iter().map(String::as_str).collect();
    let allowed: Vec<&RdmaDevice> = if named.is_empty() {
        devices.iter().collect()
    } else {
        let found: Vec<&RdmaDevice> = devices
            .iter()
            .filter(|d| named.contains(d.name.as_str()))
            .collect();
        if found.is_empty() {
            return Err(SelectError::NotAllowed {
                allowed: policy.allow.clone(),
                found: devices.iter().map(|d| d.name.clone()).collect(),
            });
        }
        for missing in named
            .iter()
            .filter(|n| !devices.iter().any(|d| d.name == **n))
        {
            notes.push(format!(
                "transport.devices names {missing}, which this host does not have"
            ));
        }
        found
    };
    let pod_vfs: Vec<String> = policy
        .pod_vfs
        .iter()
        .map(|v| v.to_ascii_lowercase())
        .collect();
    let is_pod_vf = |d: &RdmaDevice| d.pci_bus_id.as_ref().is_some_and(|b| pod_vfs.contains(b));
    let vfs: Vec<&RdmaDevice> = allowed.iter().copied().filter(|d| is_pod_vf(d)).collect();
    let candidates: Vec<&RdmaDevice> = if !vfs.is_empty() {
        for d in allowed.iter().filter(|d| !is_pod_vf(d)) {
            notes.push(format!("{}: not one of the pod's VFs; skipped", d.name));
        }
        vfs
    } else {
        if !pod_vfs.is_empty() {
            notes.push(format!(
                "the pod's VFs {pod_vfs:?} are not allowed RDMA devices of this host; using \
                 its physical functions"
            ));
        }
        allowed
            .into_iter()
            .filter(|d| {
                let keep = !d.is_vf || named.contains(d.name.as_str());
                if !keep {
                    notes.push(format!("{}: a VF not given to this pod; skipped", d.name));
                }
                keep
            })
            .collect()
    };
    let mut reasons = Vec::new();
    let mut nics = Vec::new();
    for d in candidates {
        if d.ports.is_empty() {
            reasons.push(format!("{}: no ports", d.name));
        }
        for p in &d.ports {
            if !p.active {
                reasons.push(format!("{} port {}: not ACTIVE", d.name, p.port));
                continue;
            }
            match topology::choose_gid(p, policy.gid_index) {
                Some(gid_index) => nics.push(NicChoice {
                    device: d.name.clone(),
                    port: p.port,
                    gid_index,
                    numa_node: d.numa_node,
                }),
                None => reasons.push(match policy.gid_index {
                    Some(i) => format!(
                        "{} port {}: transport.gidIndex {i} is not a populated GID entry",
                        d.name, p.port
                    ),
                    None => format!("{} port {}: no usable GID", d.name, p.port),
                }),
            }
        }
    }
    if nics.is_empty() {
        if reasons.is_empty() {
            reasons.push("no RDMA device under class/infiniband".to_owned());
        }
        return Err(SelectError::NoneUsable { reasons });
    }
    notes.extend(reasons);
    let mem = policy.numa_node;
    nics.sort_by(|a, b| {
        let remote = |n: &NicChoice| !(mem.is_some() && n.numa_node == mem);
        (remote(a), &a.device, a.port).cmp(&(remote(b), &b.device, b.port))
    });
    Ok(Selection { nics, notes })
}

/// The NICs (indices into `nic_numa`, the NUMA node of each opened NIC) that a transfer of
/// memory on `mem_numa` goes out through: those on the same node when there is one, else all.
pub fn local_nics(nic_numa: &[Option<u32>], mem_numa: Option<u32>) -> Vec<usize> {
    let local: Vec<usize> = match mem_numa {
        Some(n) => (0..nic_numa.len())
            .filter(|&i| nic_numa[i] == Some(n))
            .collect(),
        None => Vec::new(),
    };
    if local.is_empty() {
        (0..nic_numa.len()).collect()
    } else {
        local
    }
}

#[cfg(test)]
mod tests;
