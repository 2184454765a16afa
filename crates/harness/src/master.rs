//! `kvpool master` as a child process on free loopback ports: its flags ([`master_args`], also
//! what `kvpool up` plans), a spec that adds per-run flags, and the running master with its
//! gRPC and admin addresses. I/O boundary: the child process (through [`Launcher`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::command::kvpool_command;
use crate::error::HarnessError;
use crate::ports::free_addr;
use crate::probe::Probe;
use crate::process::{ChildProcess, Launcher};

/// The flags of a master serving gRPC on `grpc` and its admin server on `admin`, keyed with
/// `key_file` (after the `master` role).
pub fn master_args(grpc: SocketAddr, admin: SocketAddr, key_file: &Path) -> Vec<String> {
    vec![
        "--listen".into(),
        grpc.to_string(),
        "--admin-listen".into(),
        admin.to_string(),
        "--auth-key-file".into(),
        key_file.display().to_string(),
    ]
}

/// A master to start: the executable, the key file, two free loopback ports and extra flags.
#[derive(Clone, Debug)]
pub struct MasterSpec {
    exe: PathBuf,
    key_file: PathBuf,
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    extra: Vec<String>,
}

impl MasterSpec {
    /// `exe master` on two ports that are free now.
    pub fn new(
        exe: impl Into<PathBuf>,
        key_file: impl Into<PathBuf>,
    ) -> Result<Self, HarnessError> {
        Ok(Self {
            exe: exe.into(),
            key_file: key_file.into(),
            grpc: free_addr()?,
            admin: free_addr()?,
            extra: Vec::new(),
        })
    }

    /// More flags, e.g. `["--heartbeat-timeout", "5s"]`.
    pub fn args<S: Into<String>>(mut self, args: impl IntoIterator<Item = S>) -> Self {
        self.extra.extend(args.into_iter().map(Into::into));
        self
    }

    /// The command line, ready to spawn.
    pub fn command(&self) -> Command {
        let mut cmd = kvpool_command(&self.exe);
        cmd.arg("master")
            .args(master_args(self.grpc, self.admin, &self.key_file))
            .args(&self.extra);
        cmd
    }

    /// Starts it as child `name` (no wait).
    pub fn spawn(&self, launcher: &Launcher, name: &str) -> Result<MasterProcess, HarnessError> {
        Ok(MasterProcess {
            process: launcher.spawn(name, &mut self.command())?,
            grpc: self.grpc,
            admin: self.admin,
        })
    }

    /// Starts it as child `name` and waits up to `timeout` for its gRPC port.
    pub fn start(
        &self,
        launcher: &Launcher,
        name: &str,
        timeout: Duration,
    ) -> Result<MasterProcess, HarnessError> {
        let mut m = self.spawn(launcher, name)?;
        m.process.wait_ready(&Probe::Tcp(m.grpc), timeout)?;
        Ok(m)
    }
}

/// A started master.
#[derive(Debug)]
pub struct MasterProcess {
    pub process: ChildProcess,
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
}
