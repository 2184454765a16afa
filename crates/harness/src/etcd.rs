//! A throw-away single-member etcd (Debian's etcd-server) on free loopback ports, for the
//! master's HA tests and `kvpool bench master --with-etcd`. I/O boundary: the `etcd` child
//! process, its data directory and log file.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::error::HarnessError;
use crate::ports::free_addr;
use crate::probe::Probe;
use crate::process::{ChildProcess, Launcher};

/// How long etcd gets to accept client connections.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A single-member etcd on 127.0.0.1 with its data in `<dir>/etcd` and its log in
/// `<dir>/etcd.log`; killed on drop.
#[derive(Debug)]
pub struct EtcdServer {
    pub process: ChildProcess,
    pub client_url: String,
}

impl EtcdServer {
    /// Whether an `etcd` binary is on the PATH.
    pub fn available() -> bool {
        Command::new("etcd")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Starts etcd and waits until it accepts client connections.
    pub fn start(dir: &Path) -> Result<Self, HarnessError> {
        if !Self::available() {
            return Err(HarnessError::Missing {
                binary: "etcd",
                package: "etcd-server",
            });
        }
        let client = free_addr()?;
        let client_url = format!("http://{client}");
        let peer_url = format!("http://{}", free_addr()?);
        let mut process = Launcher::new(dir).spawn(
            "etcd",
            Command::new("etcd")
                .arg("--name=kvpool-test")
                .arg(format!("--data-dir={}", dir.join("etcd").display()))
                .arg(format!("--listen-client-urls={client_url}"))
                .arg(format!("--advertise-client-urls={client_url}"))
                .arg(format!("--listen-peer-urls={peer_url}"))
                .arg(format!("--initial-advertise-peer-urls={peer_url}"))
                .arg(format!("--initial-cluster=kvpool-test={peer_url}")),
        )?;
        process.wait_ready(&Probe::Tcp(client), START_TIMEOUT)?;
        Ok(Self {
            process,
            client_url,
        })
    }
}
