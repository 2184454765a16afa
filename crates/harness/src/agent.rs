//! `kvpool agent run` as a child process: the YAML configuration it reads ([`AgentConfig`],
//! also what `kvpool up` plans), and a spec that writes it into the agent's own directory and
//! starts the agent with it. I/O boundary: the config file and the child process.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::command::kvpool_command;
use crate::error::HarnessError;
use crate::process::{ChildProcess, Launcher};

/// The engine-API socket's file name in `engine_api.socket_dir` (the agent's `SOCKET_NAME`).
pub const SOCKET_NAME: &str = "agent.sock";

/// The `pool:` section: membership of the pool behind a master.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    pub master: Vec<String>,
    pub auth_key_file: PathBuf,
    pub heartbeat_interval: String,
    /// `pool.transport_listen`: where the agent's transfer engine listens (and, not being a
    /// wildcard, the address it announces), e.g. `127.0.0.1:0`.
    pub transport_listen: String,
    /// Further `pool:` settings, one `key: value` each (e.g. `replicas: 2`).
    pub settings: Vec<String>,
}

/// The agent's configuration file: a DRAM tier, the engine API, the admin server, optionally
/// fixture discovery roots and pool membership.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentConfig {
    pub node_name: String,
    /// `dram.capacity`, e.g. `64MiB` or a byte count.
    pub dram: String,
    pub socket_dir: PathBuf,
    /// `admin.listen`, e.g. `127.0.0.1:0`.
    pub admin_listen: String,
    pub sysfs_root: Option<PathBuf>,
    pub procfs_root: Option<PathBuf>,
    pub pool: Option<PoolConfig>,
    /// Further top-level sections, as YAML lines (e.g. an `ssd:` tier).
    pub sections: String,
}

impl AgentConfig {
    /// A local-only agent: `dram` of DRAM, its socket in `socket_dir`, admin on any port.
    pub fn new(node_name: &str, dram: &str, socket_dir: PathBuf) -> Self {
        Self {
            node_name: node_name.to_owned(),
            dram: dram.to_owned(),
            socket_dir,
            admin_listen: "127.0.0.1:0".into(),
            sysfs_root: None,
            procfs_root: None,
            pool: None,
            sections: String::new(),
        }
    }

    /// The YAML text.
    pub fn to_yaml(&self) -> String {
        let mut y = format!("node_name: {}\n", self.node_name);
        if self.sysfs_root.is_some() || self.procfs_root.is_some() {
            y.push_str("discovery:\n");
            if let Some(p) = &self.sysfs_root {
                let _ = writeln!(y, "  sysfs_root: {}", p.display());
            }
            if let Some(p) = &self.procfs_root {
                let _ = writeln!(y, "  procfs_root: {}", p.display());
            }
        }
        let _ = write!(
            y,
            "dram:\n  capacity: {}\n  lock: false\n\
             engine_api:\n  socket_dir: {}\n\
             admin:\n  listen: {}\n",
            self.dram,
            self.socket_dir.display(),
            self.admin_listen,
        );
        if let Some(p) = &self.pool {
            let masters: Vec<String> = p.master.iter().map(|m| format!("\"{m}\"")).collect();
            let _ = write!(
                y,
                "pool:\n  master: [{}]\n  auth_key_file: {}\n  transport_listen: {}\n  \
                 heartbeat_interval: {}\n",
                masters.join(", "),
                p.auth_key_file.display(),
                p.transport_listen,
                p.heartbeat_interval,
            );
            for s in &p.settings {
                let _ = writeln!(y, "  {s}");
            }
        }
        y.push_str(&self.sections);
        y
    }
}

/// An agent to start: the executable, its own directory (config, socket) and its config.
#[derive(Clone, Debug)]
pub struct AgentSpec {
    exe: PathBuf,
    dir: PathBuf,
    pub config: AgentConfig,
    extra: Vec<String>,
}

impl AgentSpec {
    /// Agent `node_name` with `dram` of DRAM living in `dir` (socket in `dir/run`).
    pub fn new(
        exe: impl Into<PathBuf>,
        dir: impl Into<PathBuf>,
        node_name: &str,
        dram: &str,
    ) -> Self {
        let dir = dir.into();
        Self {
            exe: exe.into(),
            config: AgentConfig::new(node_name, dram, dir.join("run")),
            dir,
            extra: Vec::new(),
        }
    }

    /// The admin server on `addr` instead of any port.
    pub fn admin(mut self, addr: SocketAddr) -> Self {
        self.config.admin_listen = addr.to_string();
        self
    }

    /// Topology from a fixture machine: `<root>/sys` and `<root>/proc`.
    pub fn fixture(self, root: &Path) -> Self {
        self.discovery(root.join("sys"), root.join("proc"))
    }

    /// Topology from these sysfs and procfs roots.
    pub fn discovery(mut self, sysfs: PathBuf, procfs: PathBuf) -> Self {
        self.config.sysfs_root = Some(sysfs);
        self.config.procfs_root = Some(procfs);
        self
    }

    /// Pool membership behind the master at `master`.
    pub fn pool(mut self, master: SocketAddr, key_file: &Path, heartbeat_interval: &str) -> Self {
        self.config.pool = Some(PoolConfig {
            master: vec![master.to_string()],
            auth_key_file: key_file.to_owned(),
            heartbeat_interval: heartbeat_interval.to_owned(),
            transport_listen: "127.0.0.1:0".into(),
            settings: Vec::new(),
        });
        self
    }

    /// The transfer engine on `addr` (an IP address, port 0 for any) instead of
    /// `127.0.0.1:0`; nothing without [`AgentSpec::pool`].
    pub fn transport_listen(mut self, addr: &str) -> Self {
        if let Some(p) = &mut self.config.pool {
            p.transport_listen = addr.to_owned();
        }
        self
    }

    /// One more `pool:` setting (`key: value`); nothing without [`AgentSpec::pool`].
    pub fn pool_setting(mut self, setting: &str) -> Self {
        if let Some(p) = &mut self.config.pool {
            p.settings.push(setting.to_owned());
        }
        self
    }

    /// More top-level config sections (YAML lines).
    pub fn section(mut self, yaml: &str) -> Self {
        self.config.sections.push_str(yaml);
        self
    }

    /// More flags after `run --config <file>`.
    pub fn args<S: Into<String>>(mut self, args: impl IntoIterator<Item = S>) -> Self {
        self.extra.extend(args.into_iter().map(Into::into));
        self
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.join("agent.yaml")
    }

    /// The engine-API socket.
    pub fn socket(&self) -> PathBuf {
        self.config.socket_dir.join(SOCKET_NAME)
    }

    /// Writes the config file (creating the agent's directory); returns its path.
    pub fn write_config(&self) -> Result<PathBuf, HarnessError> {
        let path = self.config_path();
        let err = |source| HarnessError::Write {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(&self.dir).map_err(err)?;
        std::fs::write(&path, self.config.to_yaml()).map_err(err)?;
        Ok(path)
    }

    /// The command line (the config file is not written).
    pub fn command(&self) -> Command {
        let mut cmd = kvpool_command(&self.exe);
        cmd.args(["agent", "run", "--config"])
            .arg(self.config_path())
            .args(&self.extra);
        cmd
    }

    /// Writes the config and starts the agent as child `<node_name>` (no wait).
    pub fn spawn(&self, launcher: &Launcher) -> Result<AgentProcess, HarnessError> {
        self.write_config()?;
        let process = launcher.spawn(&self.config.node_name, &mut self.command())?;
        Ok(AgentProcess {
            process,
            admin: self
                .config
                .admin_listen
                .parse()
                .ok()
                .filter(|a: &SocketAddr| a.port() != 0),
            socket: self.socket(),
        })
    }
}

/// A started agent.
#[derive(Debug)]
pub struct AgentProcess {
    pub process: ChildProcess,
    /// The admin server, when it was given a port.
    pub admin: Option<SocketAddr>,
    pub socket: PathBuf,
}
