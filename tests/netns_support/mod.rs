//! What the network-namespace tests share (transfer_netns, pool_netns_cut): running `ip` with a
//! clear error, whether this process is root, and a "hub and island" pair of namespaces joined
//! by a veth pair that can be cut in two ways. Everything is created under names carrying this
//! process's id and removed on drop, even when the test fails. I/O boundary: the `ip` command.

#![allow(dead_code)]

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;

/// Runs `ip args...`; its stderr in the error when it fails.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Whether the effective user is root (creating namespaces needs it).
pub fn running_as_root() -> bool {
    // /proc/self/status: "Uid:\treal\teffective\t..."
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|v| v.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

/// How a link is cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// `ip link set <island end> down`: the carrier drops on both ends; local sends fail.
    LinkDown,
    /// Every frame silently dropped in both directions while both ends stay up and every socket
    /// half-alive (what `tc netem loss 100%` does; it needs `sch_netem`, which many CI kernels
    /// lack): each end's neighbour entry for the other is pinned to a MAC address nobody has,
    /// so the peer discards the frames as addressed to another host.
    Silent,
}

/// A MAC address no interface has (locally administered).
const NOBODY: &str = "02:00:00:00:6b:76";

/// Namespaces `hub` and `island` joined by a veth pair, `hub_ip`/30 and `island_ip`/30 in
/// 10.201.<n>.0/30, loopback up in both.
pub struct HubAndIsland {
    pub hub: String,
    pub island: String,
    pub hub_dev: String,
    pub island_dev: String,
    pub hub_ip: IpAddr,
    pub island_ip: IpAddr,
}

impl HubAndIsland {
    /// Creates them; `n` (1..=250) picks the /30.
    pub fn create(n: u8) -> Result<Self, String> {
        let pid = std::process::id();
        let hub = format!("kvhub{pid}");
        ip(&["netns", "add", &hub])?;
        // From here on Drop cleans up whatever was created (a missing namespace is ignored).
        let t = HubAndIsland {
            island: format!("kvisl{pid}"),
            hub,
            hub_dev: format!("kvh{}", pid % 1_000_000),
            island_dev: format!("kvi{}", pid % 1_000_000),
            hub_ip: IpAddr::V4(Ipv4Addr::new(10, 201, n, 1)),
            island_ip: IpAddr::V4(Ipv4Addr::new(10, 201, n, 2)),
        };
        ip(&["netns", "add", &t.island])?;
        ip(&[
            "link",
            "add",
            &t.hub_dev,
            "netns",
            &t.hub,
            "type",
            "veth",
            "peer",
            "name",
            &t.island_dev,
            "netns",
            &t.island,
        ])?;
        for (space, dev, addr) in [
            (&t.hub, &t.hub_dev, t.hub_ip),
            (&t.island, &t.island_dev, t.island_ip),
        ] {
            ip(&[
                "-n",
                space,
                "addr",
                "add",
                &format!("{addr}/30"),
                "dev",
                dev,
            ])?;
            ip(&["-n", space, "link", "set", "lo", "up"])?;
            ip(&["-n", space, "link", "set", dev, "up"])?;
        }
        Ok(t)
    }

    /// `/var/run/netns/<hub>`, for `setns`.
    pub fn hub_path(&self) -> String {
        format!("/var/run/netns/{}", self.hub)
    }

    /// Cuts the link the way `how` says.
    pub fn cut(&self, how: Cut) -> Result<(), String> {
        match how {
            Cut::LinkDown => ip(&["-n", &self.island, "link", "set", &self.island_dev, "down"]),
            Cut::Silent => {
                for (space, dev, peer) in self.ends() {
                    ip(&[
                        "-n",
                        space,
                        "neigh",
                        "replace",
                        &peer,
                        "lladdr",
                        NOBODY,
                        "dev",
                        dev,
                        "nud",
                        "permanent",
                    ])?;
                }
                Ok(())
            }
        }
    }

    /// Undoes [`Self::cut`].
    pub fn restore(&self, how: Cut) -> Result<(), String> {
        match how {
            Cut::LinkDown => ip(&["-n", &self.island, "link", "set", &self.island_dev, "up"]),
            Cut::Silent => {
                for (space, dev, peer) in self.ends() {
                    ip(&["-n", space, "neigh", "del", &peer, "dev", dev])?;
                }
                Ok(())
            }
        }
    }

    /// (namespace, device, the other end's address) of each end.
    fn ends(&self) -> [(&str, &str, String); 2] {
        [
            (&self.hub, &self.hub_dev, self.island_ip.to_string()),
            (&self.island, &self.island_dev, self.hub_ip.to_string()),
        ]
    }
}

impl Drop for HubAndIsland {
    fn drop(&mut self) {
        // Deleting a namespace also deletes the veth end inside it (and so its peer).
        let _ = ip(&["netns", "del", &self.island]);
        let _ = ip(&["netns", "del", &self.hub]);
    }
}

/// The TCP sockets in namespace `ns` to `peer` (any state, orphans included) that still hold
/// bytes not yet acknowledged by the peer: `(state, send-queue bytes)` for each, from `ss`.
pub fn unsent_to(ns: &str, peer: &str) -> Result<Vec<(String, u64)>, String> {
    let out = Command::new("ip")
        .args([
            "netns", "exec", ns, "ss", "-tnH", "state", "all", "dst", peer,
        ])
        .output()
        .map_err(|e| format!("cannot run ss in {ns}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "ss in {ns} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    // Columns: State Recv-Q Send-Q Local:Port Peer:Port
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut cols = l.split_whitespace();
            let state = cols.next()?.to_string();
            let send_q = cols.nth(1)?.parse::<u64>().ok()?;
            (send_q > 0).then_some((state, send_q))
        })
        .collect())
}
