//! Topology discovery: reads NUMA nodes, GPUs, RDMA devices and SR-IOV functions from a sysfs
//! root and a procfs root (configurable, so tests read fixture trees), plus the device plugin's
//! `PCIDEVICE_*` variables passed in as a map. I/O boundary: read-only filesystem access under
//! the two roots. Unreadable or malformed entries become [`Warning`]s; only a missing sysfs root
//! is an error. A PCI device's NUMA node is read by the transfer engine's `pci_numa_node`, the
//! reader GPU segments use too.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use kvpool_transfer::memory::{NumaNodeError, numa_node_file, pci_numa_node};

use crate::topology::{
    GidEntry, Gpu, HugePagePool, NumaNode, PodVf, RdmaDevice, RdmaPort, SriovPf, SriovVf, Topology,
    Warning, compute_matrix, is_pci_bus_id, parse_cpulist,
};

/// PCI vendor ids whose display/3D controllers count as GPUs.
const GPU_VENDORS: [&str; 2] = ["0x10de", "0x1002"];
/// PCI class prefixes of GPUs: VGA (0x0300), 3D controller (0x0302), other display (0x0380).
const GPU_CLASSES: [&str; 3] = ["0x0300", "0x0302", "0x0380"];
/// Prefix of the variables SR-IOV device plugins set with the allocated bus ids.
pub const DEVICE_PLUGIN_ENV_PREFIX: &str = "PCIDEVICE_";

/// Errors of discovery.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum DiscoveryError {
    #[error("sysfs root {path} is not readable")]
    SysfsRoot {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

kvpool_runtime::error_category!(DiscoveryError);

/// Where to read from.
#[derive(Clone, Debug)]
pub struct Roots {
    pub sysfs: PathBuf,
    pub procfs: PathBuf,
}

impl Default for Roots {
    fn default() -> Self {
        Self {
            sysfs: PathBuf::from("/sys"),
            procfs: PathBuf::from("/proc"),
        }
    }
}

/// Reader that records warnings with paths relative to the roots.
struct Reader<'a> {
    roots: &'a Roots,
    sys_canonical: PathBuf,
    warnings: Vec<Warning>,
}

impl Reader<'_> {
    fn rel(&self, path: &Path) -> String {
        path.strip_prefix(&self.roots.sysfs)
            .map(|p| format!("sys/{}", p.display()))
            .or_else(|_| {
                path.strip_prefix(&self.roots.procfs)
                    .map(|p| format!("proc/{}", p.display()))
            })
            .unwrap_or_else(|_| path.display().to_string())
    }

    fn warn(&mut self, path: &Path, message: impl Into<String>) {
        let path = self.rel(path);
        self.warnings.push(Warning {
            path,
            message: message.into(),
        });
    }

    /// Read a file that should exist; warn when it does not.
    fn read(&mut self, path: &Path) -> Option<String> {
        match fs::read_to_string(path) {
            Ok(s) => Some(s.trim().to_owned()),
            Err(e) => {
                self.warn(path, format!("cannot read: {e}"));
                None
            }
        }
    }

    /// Read a file that may legitimately be absent.
    fn read_optional(&mut self, path: &Path) -> Option<String> {
        match fs::read_to_string(path) {
            Ok(s) => Some(s.trim().to_owned()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                self.warn(path, format!("cannot read: {e}"));
                None
            }
        }
    }

    fn read_u64(&mut self, path: &Path) -> Option<u64> {
        let text = self.read(path)?;
        match text.parse() {
            Ok(v) => Some(v),
            Err(_) => {
                self.warn(path, format!("not an unsigned integer: {text:?}"));
                None
            }
        }
    }

    /// `numa_node` of a PCI device: -1 means unknown (the transfer engine's reader, so that
    /// GPU segments and discovery agree).
    fn read_numa(&mut self, path: &Path) -> Option<u32> {
        self.numa_result(path, numa_node_file(path))
    }

    /// The NUMA node of PCI device `bdf` (`bus/pci/devices/<bdf>/numa_node`), the way
    /// `Segment::on_gpu` reads it.
    fn pci_numa(&mut self, bdf: &str) -> Option<u32> {
        let found = pci_numa_node(&self.roots.sysfs, bdf);
        let path = match &found {
            Err(e) => e.path().to_owned(),
            Ok(_) => PathBuf::new(),
        };
        self.numa_result(&path, found)
    }

    fn numa_result(
        &mut self,
        path: &Path,
        found: Result<Option<u32>, NumaNodeError>,
    ) -> Option<u32> {
        match found {
            Ok(node) => node,
            Err(NumaNodeError::Read { source, .. }) => {
                self.warn(path, format!("cannot read: {source}"));
                None
            }
            Err(NumaNodeError::OutOfRange { value, .. }) => {
                self.warn(path, format!("invalid NUMA node {value}"));
                None
            }
            Err(NumaNodeError::NotANumber { text, .. }) => {
                self.warn(path, format!("not a NUMA node number: {text:?}"));
                None
            }
        }
    }

    /// Sorted entry names of a directory; warns when it should exist and does not.
    fn list(&mut self, dir: &Path, required: bool) -> Vec<String> {
        match fs::read_dir(dir) {
            Ok(rd) => {
                let mut names: Vec<String> = rd
                    .filter_map(Result::ok)
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect();
                names.sort_by_key(|n| natural_key(n));
                names
            }
            Err(e) => {
                if required || e.kind() != std::io::ErrorKind::NotFound {
                    self.warn(dir, format!("cannot list: {e}"));
                }
                Vec::new()
            }
        }
    }

    /// Resolve a PCI device link to (bus id, path below /sys/devices).
    fn resolve_pci(&mut self, link: &Path) -> Option<(String, Vec<String>)> {
        let target = match fs::canonicalize(link) {
            Ok(t) => t,
            Err(e) => {
                self.warn(link, format!("cannot resolve device link: {e}"));
                return None;
            }
        };
        let bus_id = target.file_name()?.to_str()?.to_owned();
        if !is_pci_bus_id(&bus_id) {
            self.warn(link, format!("link target {bus_id:?} is not a PCI device"));
            return None;
        }
        let devices = self.sys_canonical.join("devices");
        let path = match target.strip_prefix(&devices) {
            Ok(rel) => rel
                .components()
                .filter_map(|c| c.as_os_str().to_str().map(str::to_owned))
                .collect(),
            Err(_) => {
                self.warn(link, "device link points outside sys/devices");
                vec![bus_id.clone()]
            }
        };
        Some((bus_id, path))
    }
}

/// Sort key that orders `node10` after `node2`.
fn natural_key(s: &str) -> (String, u64, String) {
    let start = s.find(|c: char| c.is_ascii_digit()).unwrap_or(s.len());
    let digits: String = s[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    let rest = s[start + digits.len()..].to_owned();
    (s[..start].to_owned(), digits.parse().unwrap_or(0), rest)
}

/// Discover the topology. `env` holds the process environment (only `PCIDEVICE_*` is used).
pub fn discover(roots: &Roots, env: &BTreeMap<String, String>) -> Result<Topology, DiscoveryError> {
    let sys_canonical =
        fs::canonicalize(&roots.sysfs).map_err(|source| DiscoveryError::SysfsRoot {
            path: roots.sysfs.clone(),
            source,
        })?;
    let mut r = Reader {
        roots,
        sys_canonical,
        warnings: Vec::new(),
    };
    let mut topo = Topology {
        numa_nodes: numa_nodes(&mut r),
        ..Topology::default()
    };
    let single_node = match topo.numa_nodes.as_slice() {
        [only] => Some(only.id),
        _ => None,
    };

    // PCI devices: GPUs and SR-IOV physical functions.
    let pci_dir = roots.sysfs.join("bus/pci/devices");
    let mut pfs = Vec::new();
    for name in r.list(&pci_dir, true) {
        let dev = pci_dir.join(&name);
        let Some(class) = r.read_optional(&dev.join("class")) else {
            r.warn(&dev.join("class"), "missing");
            continue;
        };
        if let Some(total) = r.read_optional(&dev.join("sriov_totalvfs")) {
            pfs.push((name.clone(), total));
        }
        let vendor = r.read_optional(&dev.join("vendor")).unwrap_or_default();
        let is_gpu = GPU_VENDORS.contains(&vendor.as_str())
            && GPU_CLASSES.iter().any(|c| class.starts_with(c));
        if !is_gpu {
            continue;
        }
        let (bus_id, pci_path) = r
            .resolve_pci(&dev)
            .unwrap_or_else(|| (name.clone(), vec![name.clone()]));
        let numa_node = r.pci_numa(&name).or(single_node);
        let device = r.read(&dev.join("device")).unwrap_or_default();
        topo.gpus.push(Gpu {
            pci_bus_id: bus_id,
            vendor,
            device,
            class,
            numa_node,
            pci_path,
            cuda: None,
        });
    }

    topo.rdma_devices = rdma_devices(&mut r, single_node);
    let rdma_by_bus: BTreeMap<String, String> = topo
        .rdma_devices
        .iter()
        .filter_map(|d| d.pci_bus_id.clone().map(|b| (b, d.name.clone())))
        .collect();

    for (pf, total) in pfs {
        let dev = pci_dir.join(&pf);
        let Ok(total_vfs) = total.parse::<u32>() else {
            r.warn(
                &dev.join("sriov_totalvfs"),
                format!("not a number: {total:?}"),
            );
            continue;
        };
        let num_vfs = match r.read(&dev.join("sriov_numvfs")).map(|s| s.parse::<u32>()) {
            Some(Ok(n)) => n,
            Some(Err(_)) => {
                r.warn(&dev.join("sriov_numvfs"), "not a number");
                0
            }
            None => 0,
        };
        let mut vfs = Vec::new();
        for entry in r.list(&dev, true) {
            let Some(index) = entry
                .strip_prefix("virtfn")
                .and_then(|i| i.parse::<u32>().ok())
            else {
                continue;
            };
            if let Some((bus_id, _)) = r.resolve_pci(&dev.join(&entry)) {
                let rdma_device = rdma_by_bus.get(&bus_id).cloned();
                vfs.push(SriovVf {
                    index,
                    bus_id,
                    rdma_device,
                });
            }
        }
        vfs.sort_by_key(|v| v.index);
        if usize::try_from(num_vfs).is_ok_and(|n| n != vfs.len()) {
            r.warn(
                &dev,
                format!(
                    "sriov_numvfs is {num_vfs} but {} virtfn links exist",
                    vfs.len()
                ),
            );
        }
        topo.sriov.push(SriovPf {
            rdma_device: rdma_by_bus.get(&pf).cloned(),
            pf_bus_id: pf,
            total_vfs,
            num_vfs,
            vfs,
        });
    }

    // VFs allocated to this pod.
    for (var, value) in env.range(DEVICE_PLUGIN_ENV_PREFIX.to_owned()..) {
        if !var.starts_with(DEVICE_PLUGIN_ENV_PREFIX) {
            break;
        }
        for bus_id in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if !is_pci_bus_id(bus_id) {
                r.warnings.push(Warning {
                    path: format!("env/{var}"),
                    message: format!("not a PCI bus id: {bus_id:?}"),
                });
                continue;
            }
            let dev = pci_dir.join(bus_id);
            if !dev.exists() {
                r.warnings.push(Warning {
                    path: format!("env/{var}"),
                    message: format!("PCI device {bus_id} does not exist"),
                });
                continue;
            }
            let physfn = dev.join("physfn");
            let pf_bus_id = if physfn.exists() {
                r.resolve_pci(&physfn).map(|(b, _)| b)
            } else {
                None
            };
            topo.pod_vfs.push(PodVf {
                env: var.clone(),
                bus_id: bus_id.to_owned(),
                rdma_device: rdma_by_bus.get(bus_id).cloned(),
                pf_rdma_device: pf_bus_id.as_ref().and_then(|b| rdma_by_bus.get(b).cloned()),
                pf_bus_id,
            });
        }
    }

    topo.matrix = compute_matrix(&topo);
    r.warnings.sort();
    topo.warnings = r.warnings;
    Ok(topo)
}

fn numa_nodes(r: &mut Reader<'_>) -> Vec<NumaNode> {
    let node_dir = r.roots.sysfs.join("devices/system/node");
    let names: Vec<(u32, String)> = r
        .list(&node_dir, false)
        .into_iter()
        .filter_map(|n| Some((n.strip_prefix("node")?.parse().ok()?, n)))
        .collect();
    if names.is_empty() {
        return vec![single_node_from_proc(r)];
    }
    let mut nodes = Vec::new();
    for (id, name) in names {
        let dir = node_dir.join(&name);
        let cpus = match r.read(&dir.join("cpulist")) {
            Some(text) => parse_cpulist(&text).unwrap_or_else(|| {
                r.warn(&dir.join("cpulist"), format!("malformed cpulist {text:?}"));
                Vec::new()
            }),
            None => Vec::new(),
        };
        let (mem_total_bytes, mem_free_bytes) = match r.read(&dir.join("meminfo")) {
            Some(text) => {
                let fields = parse_meminfo(&text);
                let total = fields.get("MemTotal").copied();
                let free = fields.get("MemFree").copied();
                if total.is_none() || free.is_none() {
                    r.warn(&dir.join("meminfo"), "MemTotal or MemFree missing");
                }
                (
                    total.unwrap_or(0),
                    free.map_or(0, |f| f + reclaimable(&fields)),
                )
            }
            None => (0, 0),
        };
        let hugepages = hugepage_pools(r, &dir.join("hugepages"));
        nodes.push(NumaNode {
            id,
            cpus,
            mem_total_bytes,
            mem_free_bytes,
            hugepages,
        });
    }
    nodes
}

/// A machine without /sys/devices/system/node (NUMA disabled): one node from /proc/meminfo and
/// /sys/devices/system/cpu/online.
fn single_node_from_proc(r: &mut Reader<'_>) -> NumaNode {
    let mut node = NumaNode::default();
    let online = r.roots.sysfs.join("devices/system/cpu/online");
    if let Some(text) = r.read(&online) {
        node.cpus = parse_cpulist(&text).unwrap_or_else(|| {
            r.warn(&online, format!("malformed cpulist {text:?}"));
            Vec::new()
        });
    }
    let meminfo = r.roots.procfs.join("meminfo");
    if let Some(text) = r.read(&meminfo) {
        let fields = parse_meminfo(&text);
        node.mem_total_bytes = fields.get("MemTotal").copied().unwrap_or(0);
        node.mem_free_bytes = fields
            .get("MemAvailable")
            .or_else(|| fields.get("MemFree"))
            .copied()
            .unwrap_or(0);
    }
    node.hugepages = hugepage_pools(r, &r.roots.sysfs.join("kernel/mm/hugepages"));
    node
}

/// Bytes a node's `meminfo` says the kernel reclaims on demand: the page cache's file pages
/// (`Active(file)`, `Inactive(file)`; not `Shmem`, which tmpfs pins) and reclaimable slab.
/// A node whose memory is mostly page cache (a build machine, a node that just read model
/// weights) can still give it to a DRAM tier.
fn reclaimable(fields: &BTreeMap<String, u64>) -> u64 {
    let get = |k: &str| fields.get(k).copied().unwrap_or(0);
    let slab = fields
        .get("KReclaimable")
        .or_else(|| fields.get("SReclaimable"))
        .copied()
        .unwrap_or(0);
    get("Active(file)")
        .saturating_add(get("Inactive(file)"))
        .saturating_add(slab)
}

/// Parse `meminfo` lines (`Node 0 MemTotal:  123 kB` or `MemTotal:  123 kB`) into bytes.
pub fn parse_meminfo(text: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some((head, value)) = line.split_once(':') else {
            continue;
        };
        let key = head.split_whitespace().last().unwrap_or_default();
        let mut parts = value.split_whitespace();
        let Some(Ok(n)) = parts.next().map(str::parse::<u64>) else {
            continue;
        };
        let bytes = match parts.next() {
            Some("kB") => n.saturating_mul(1024),
            _ => n,
        };
        out.insert(key.to_owned(), bytes);
    }
    out
}

fn hugepage_pools(r: &mut Reader<'_>, dir: &Path) -> Vec<HugePagePool> {
    let mut pools = Vec::new();
    for name in r.list(dir, false) {
        let Some(kb) = name
            .strip_prefix("hugepages-")
            .and_then(|s| s.strip_suffix("kB"))
            .and_then(|s| s.parse::<u64>().ok())
        else {
            continue;
        };
        let sub = dir.join(&name);
        let total = r.read_u64(&sub.join("nr_hugepages")).unwrap_or(0);
        let free = r.read_u64(&sub.join("free_hugepages")).unwrap_or(0);
        pools.push(HugePagePool {
            page_size_bytes: kb * 1024,
            total,
            free,
        });
    }
    pools.sort_by_key(|p| p.page_size_bytes);
    pools
}

fn rdma_devices(r: &mut Reader<'_>, single_node: Option<u32>) -> Vec<RdmaDevice> {
    let class_dir = r.roots.sysfs.join("class/infiniband");
    let mut out = Vec::new();
    for name in r.list(&class_dir, false) {
        let dir = class_dir.join(&name);
        let mut dev = RdmaDevice {
            name: name.clone(),
            ..RdmaDevice::default()
        };
        let device_link = dir.join("device");
        if let Some((bus_id, path)) = r.resolve_pci(&device_link) {
            dev.pci_bus_id = Some(bus_id);
            dev.pci_path = path;
            dev.numa_node = r.read_numa(&device_link.join("numa_node")).or(single_node);
            dev.netdevs = r.list(&device_link.join("net"), false);
            let physfn = device_link.join("physfn");
            if physfn.exists() {
                dev.pf_bus_id = r.resolve_pci(&physfn).map(|(b, _)| b);
            }
        }
        let ports_dir = dir.join("ports");
        for port_name in r.list(&ports_dir, true) {
            let Ok(port) = port_name.parse::<u32>() else {
                continue;
            };
            let pdir = ports_dir.join(&port_name);
            let state = match r.read(&pdir.join("state")) {
                // "4: ACTIVE"
                Some(s) => s
                    .split_once(':')
                    .map_or(s.as_str(), |(_, name)| name)
                    .trim()
                    .to_owned(),
                None => "UNKNOWN".to_owned(),
            };
            let link_layer = r
                .read(&pdir.join("link_layer"))
                .unwrap_or_else(|| "unknown".to_owned());
            let rate = r.read_optional(&pdir.join("rate"));
            let mut gids = Vec::new();
            for gid_name in r.list(&pdir.join("gids"), false) {
                let Ok(index) = gid_name.parse::<u32>() else {
                    continue;
                };
                let Some(gid) = r.read(&pdir.join("gids").join(&gid_name)) else {
                    continue;
                };
                if gid.chars().all(|c| c == '0' || c == ':') {
                    continue;
                }
                let gid_type = r.read_optional(&pdir.join("gid_attrs/types").join(&gid_name));
                let netdev = r.read_optional(&pdir.join("gid_attrs/ndevs").join(&gid_name));
                gids.push(GidEntry {
                    index,
                    gid,
                    gid_type,
                    netdev,
                });
            }
            dev.ports.push(RdmaPort {
                port,
                state,
                link_layer,
                rate,
                gids,
            });
        }
        out.push(dev);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_cache_and_reclaimable_slab_count_as_available_shmem_does_not() {
        let node = "Node 0 MemTotal: 1000 kB\nNode 0 MemFree: 100 kB\nNode 0 Active(file): 300 kB\n\
                    Node 0 Inactive(file): 200 kB\nNode 0 Shmem: 50 kB\nNode 0 SReclaimable: 40 kB\n";
        assert_eq!(reclaimable(&parse_meminfo(node)), (300 + 200 + 40) * 1024);
        // KReclaimable (kernels from 4.20) already includes SReclaimable.
        let k = format!("{node}Node 0 KReclaimable: 60 kB\n");
        assert_eq!(reclaimable(&parse_meminfo(&k)), (300 + 200 + 60) * 1024);
        assert_eq!(reclaimable(&parse_meminfo("Node 0 MemFree: 1 kB")), 0);
    }

    #[test]
    fn meminfo_parses_node_and_proc_forms() {
        let node =
            "Node 0 MemTotal:       1000 kB\nNode 0 MemFree:   10 kB\nNode 0 HugePages_Total: 4\n";
        let m = parse_meminfo(node);
        assert_eq!(m.get("MemTotal"), Some(&1_024_000));
        assert_eq!(m.get("MemFree"), Some(&10_240));
        assert_eq!(m.get("HugePages_Total"), Some(&4));
        let proc = "MemTotal: 2 kB\nbogus line\nMemAvailable: x kB\n";
        let m = parse_meminfo(proc);
        assert_eq!(m.get("MemTotal"), Some(&2048));
        assert_eq!(m.get("MemAvailable"), None);
    }

    #[test]
    fn natural_order() {
        let mut v = vec!["node10", "node2", "node1"];
        v.sort_by_key(|n| natural_key(n));
        assert_eq!(v, vec!["node1", "node2", "node10"]);
    }

    #[test]
    fn missing_root_is_an_error() {
        let roots = Roots {
            sysfs: PathBuf::from("/nonexistent/kvpool/sys"),
            procfs: PathBuf::from("/nonexistent/kvpool/proc"),
        };
        let err = discover(&roots, &BTreeMap::new()).expect_err("must fail");
        assert_eq!(err.category(), "sysfs_root");
    }
}
