//! RDMA device discovery from sysfs (`class/infiniband/*`), RoCE v2 GID choice, and NIC ranking
//! by topology. Reads a configurable root so that fixture trees of real machines test it.
//! I/O boundary: file reads under the sysfs root; the choice functions are pure.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

/// Errors of sysfs discovery.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum TopologyError {
    #[error("reading {path} failed")]
    #[strum(serialize = "sysfs_read")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl TopologyError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// Type of a GID table entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GidKind {
    RoceV2,
    /// "IB/RoCE v1": InfiniBand, or RoCE v1 on Ethernet.
    IbOrRoceV1,
    Other(String),
}

/// One populated entry of a port's GID table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidEntry {
    pub index: u32,
    pub gid: [u8; 16],
    pub kind: GidKind,
}

impl GidEntry {
    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        let g = &self.gid;
        if g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff {
            Some(Ipv4Addr::new(g[12], g[13], g[14], g[15]))
        } else {
            None
        }
    }

    fn is_link_local(&self) -> bool {
        self.gid[0] == 0xfe && (self.gid[1] & 0xc0) == 0x80
    }
}

/// A port of an RDMA device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaPort {
    pub port: u8,
    pub active: bool,
    /// "Ethernet" (RoCE) or "InfiniBand".
    pub link_layer: String,
    pub gids: Vec<GidEntry>,
}

/// An RDMA device as sysfs describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaDevice {
    pub name: String,
    pub numa_node: Option<u32>,
    /// PCI address of the function behind the device (`0000:19:00.2`), from the `device` link;
    /// `None` for software devices (rxe, siw) or an unresolvable link.
    pub pci_bus_id: Option<String>,
    /// An SR-IOV virtual function (its PCI function has a `physfn` link).
    pub is_vf: bool,
    pub ports: Vec<RdmaPort>,
}

fn read_trim(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

fn sorted_entries(dir: &Path) -> Result<Vec<(String, PathBuf)>, TopologyError> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(TopologyError::Read {
                path: dir.to_owned(),
                source,
            });
        }
    };
    let mut v: Vec<_> = rd
        .filter_map(Result::ok)
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .collect();
    v.sort();
    Ok(v)
}

/// Parse a sysfs GID ("fe80:0000:0000:0000:0202:c9ff:fe00:0001": eight 16-bit hex groups).
pub fn parse_gid(s: &str) -> Option<[u8; 16]> {
    let groups: Vec<&str> = s.trim().split(':').collect();
    if groups.len() != 8 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, g) in groups.iter().enumerate() {
        let v = u16::from_str_radix(g, 16).ok()?;
        out[2 * i..2 * i + 2].copy_from_slice(&v.to_be_bytes());
    }
    Some(out)
}

/// Whether `s` is a PCI address in sysfs form, `dddd:bb:dd.f` (hex digits).
pub fn is_pci_bus_id(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && b.iter()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

/// Scan `<root>/class/infiniband`. A missing directory means no devices.
pub fn scan(sysfs_root: &Path) -> Result<Vec<RdmaDevice>, TopologyError> {
    let mut devices = Vec::new();
    for (name, dev) in sorted_entries(&sysfs_root.join("class/infiniband"))? {
        let numa_node = read_trim(&dev.join("device/numa_node"))
            .and_then(|s| s.parse::<i64>().ok())
            .and_then(|n| u32::try_from(n).ok());
        let pci_bus_id = std::fs::canonicalize(dev.join("device"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .filter(|b| is_pci_bus_id(b));
        let is_vf = dev.join("device/physfn").exists();
        let mut ports = Vec::new();
        for (pname, pdir) in sorted_entries(&dev.join("ports"))? {
            let Ok(port) = pname.parse::<u8>() else {
                continue;
            };
            let active = read_trim(&pdir.join("state")).is_some_and(|s| s.contains("ACTIVE"));
            let link_layer = read_trim(&pdir.join("link_layer")).unwrap_or_default();
            let mut gids = Vec::new();
            for (gname, gpath) in sorted_entries(&pdir.join("gids"))? {
                let Ok(index) = gname.parse::<u32>() else {
                    continue;
                };
                let Some(gid) = read_trim(&gpath).as_deref().and_then(parse_gid) else {
                    continue;
                };
                if gid.iter().all(|&b| b == 0) {
                    continue; // unpopulated entry
                }
                // The kernel answers EINVAL for the type of an unpopulated entry.
                let kind = match read_trim(&pdir.join("gid_attrs/types").join(&gname)).as_deref() {
                    Some("RoCE v2") => GidKind::RoceV2,
                    Some("IB/RoCE v1") => GidKind::IbOrRoceV1,
                    Some(other) => GidKind::Other(other.to_owned()),
                    None => GidKind::Other(String::new()),
                };
                gids.push(GidEntry { index, gid, kind });
            }
            gids.sort_by_key(|g| g.index);
            ports.push(RdmaPort {
                port,
                active,
                link_layer,
                gids,
            });
        }
        devices.push(RdmaDevice {
            name,
            numa_node,
            pci_bus_id,
            is_vf,
            ports,
        });
    }
    Ok(devices)
}

/// Choose the GID index for a port: the override if it names a populated entry; else on
/// Ethernet a RoCE v2 IPv4-mapped GID, then any RoCE v2 GID that is not link-local, then any
/// RoCE v2; on InfiniBand the first entry.
pub fn choose_gid(port: &RdmaPort, override_index: Option<u32>) -> Option<u32> {
    if let Some(i) = override_index {
        return port.gids.iter().find(|g| g.index == i).map(|g| g.index);
    }
    if port.link_layer == "InfiniBand" {
        return port.gids.first().map(|g| g.index);
    }
    let v2 = || port.gids.iter().filter(|g| g.kind == GidKind::RoceV2);
    v2().find(|g| g.ipv4().is_some())
        .or_else(|| v2().find(|g| !g.is_link_local()))
        .or_else(|| v2().next())
        .map(|g| g.index)
}

/// A usable (device, port, GID) with its NUMA node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicChoice {
    pub device: String,
    pub port: u8,
    pub gid_index: u32,
    pub numa_node: Option<u32>,
}

/// Usable NICs for memory on `mem_numa`, best first: active ports with a usable GID, limited to
/// `allow` when it is not empty; NICs on the memory's NUMA node first, then the rest, by name.
pub fn rank_nics(
    devices: &[RdmaDevice],
    mem_numa: Option<u32>,
    allow: &[String],
    gid_override: Option<u32>,
) -> Vec<NicChoice> {
    let mut out: Vec<NicChoice> = devices
        .iter()
        .filter(|d| allow.is_empty() || allow.iter().any(|a| a == &d.name))
        .flat_map(|d| {
            d.ports.iter().filter(|p| p.active).filter_map(move |p| {
                choose_gid(p, gid_override).map(|gid_index| NicChoice {
                    device: d.name.clone(),
                    port: p.port,
                    gid_index,
                    numa_node: d.numa_node,
                })
            })
        })
        .collect();
    out.sort_by_key(|n| {
        let local = mem_numa.is_some() && n.numa_node == mem_numa;
        (!local, n.device.clone(), n.port)
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/sysfs")
            .join(name)
    }

    #[test]
    fn gids_parse_and_ipv4_mapping_is_recognised() {
        let g = parse_gid("0000:0000:0000:0000:0000:ffff:0a00:0102").unwrap();
        let e = GidEntry {
            index: 3,
            gid: g,
            kind: GidKind::RoceV2,
        };
        assert_eq!(e.ipv4(), Some(Ipv4Addr::new(10, 0, 1, 2)));
        assert!(parse_gid("fe80::1").is_none());
        assert!(parse_gid("zz80:0000:0000:0000:0000:0000:0000:0001").is_none());
    }

    #[test]
    fn dual_socket_roce_host_is_scanned_and_ranked_by_numa() {
        let devs = scan(&fixture("dual-roce")).unwrap();
        let names: Vec<_> = devs.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["mlx5_0", "mlx5_1", "mlx5_2"]);
        assert_eq!(devs[0].numa_node, Some(0));
        assert_eq!(devs[1].numa_node, Some(1));
        // Port 1 of mlx5_0: link-local v1 + v2 at 0/1, IPv4-mapped v1 + v2 at 2/3.
        let p = &devs[0].ports[0];
        assert_eq!(choose_gid(p, None), Some(3));
        assert_eq!(choose_gid(p, Some(1)), Some(1));
        assert_eq!(choose_gid(p, Some(7)), None, "override of an empty entry");
        let ranked = rank_nics(&devs, Some(1), &[], None);
        let order: Vec<_> = ranked.iter().map(|n| n.device.as_str()).collect();
        // mlx5_2 is down and left out; the NUMA-1 NIC comes first.
        assert_eq!(order, ["mlx5_1", "mlx5_0"]);
        let allow = vec!["mlx5_0".to_owned()];
        assert_eq!(rank_nics(&devs, Some(1), &allow, None).len(), 1);
    }

    #[test]
    fn infiniband_port_uses_its_first_gid_and_empty_roots_have_no_devices() {
        let devs = scan(&fixture("ib-single")).unwrap();
        assert_eq!(devs.len(), 1);
        assert_eq!(devs[0].numa_node, None, "numa_node -1 means unknown");
        assert_eq!(choose_gid(&devs[0].ports[0], None), Some(0));
        let empty = tempfile::tempdir().unwrap();
        assert!(scan(empty.path()).unwrap().is_empty());
    }
}
