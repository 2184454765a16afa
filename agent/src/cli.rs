//! The flags of `kvpool agent ...` (clap), a subcommand group of the `kvpool` binary. Public so
//! that packaging tests parse container args with the binary's parser. I/O boundary: none.

use std::path::PathBuf;

use bytesize::ByteSize;
use clap::{Args, Subcommand};

use crate::config::FileConfig;

/// Subcommands of `kvpool agent`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent (the DaemonSet's command). Every flag overrides the field of the
    /// configuration file named in its help; unset, the file's value (or its default) holds.
    // Boxed: the flags are many, and the binary's command enum holds this one.
    Run(Box<RunArgs>),
    /// Print the discovered topology as JSON and exit.
    Discover(DiscoverArgs),
    /// Validate a configuration and print the effective settings.
    CheckConfig(Box<RunArgs>),
}

/// Flags of `run`; each overrides the config file's field of the same name.
#[derive(Debug, Args, Default)]
pub struct RunArgs {
    /// YAML configuration file.
    #[arg(long, env = "KVPOOL_AGENT_CONFIG", conflicts_with = "pool_config")]
    pub config: Option<PathBuf>,
    /// The operator's pool document (the KVCachePool ConfigMap's config.yaml) instead of
    /// --config; flags still override what it sets.
    #[arg(long, value_name = "FILE")]
    pub pool_config: Option<PathBuf>,
    /// Kubernetes node name (node_name). Default: $NODE_NAME, else /etc/hostname.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// sysfs root (discovery.sysfs_root). Default: /sys.
    #[arg(long)]
    pub sysfs_root: Option<PathBuf>,
    /// procfs root (discovery.procfs_root). Default: /proc.
    #[arg(long)]
    pub procfs_root: Option<PathBuf>,
    /// DRAM tier size (dram.capacity), e.g. 64GiB. Default: 1GiB.
    #[arg(long)]
    pub dram_capacity: Option<ByteSize>,
    /// Huge page size for the DRAM tier (dram.hugepages): none, 2MiB or 1GiB. Default: none.
    #[arg(long)]
    pub hugepages: Option<String>,
    /// Keep the DRAM tier in files in this tmpfs directory so it survives a restart
    /// (dram.persistence.path, mode tmpfs unless the file sets another).
    #[arg(long)]
    pub dram_persistence_path: Option<PathBuf>,
    /// SSD tier directory (ssd.path). Default: no SSD tier.
    #[arg(long)]
    pub ssd_path: Option<PathBuf>,
    /// SSD tier size (ssd.capacity).
    #[arg(long)]
    pub ssd_capacity: Option<ByteSize>,
    /// Engine API socket directory (engine_api.socket_dir). Default: /run/kvpool.
    #[arg(long)]
    pub socket_dir: Option<PathBuf>,
    /// Staging file directory (engine_api.shm_dir). Default: the socket directory.
    #[arg(long)]
    pub shm_dir: Option<PathBuf>,
    /// Admin listen address (admin.listen). Default: 0.0.0.0:9464.
    #[arg(long)]
    pub admin_listen: Option<String>,
    /// Master address, repeatable (pool.master); without it the agent runs local-only.
    #[arg(long, env = "KVPOOL_MASTER", value_delimiter = ',')]
    pub master: Vec<String>,
    /// Pool key file (pool.auth_key_file).
    #[arg(long, env = "KVPOOL_AUTH_KEY_FILE")]
    pub auth_key_file: Option<PathBuf>,
    /// Transfer-engine TCP listen address (pool.transport_listen). Default: 0.0.0.0:12345.
    #[arg(long)]
    pub transport_listen: Option<String>,
    /// Host announced in transfer endpoints (pool.advertise_host). Default: the listen address's
    /// IP (required when that is a wildcard).
    #[arg(long, env = "POD_IP")]
    pub advertise_host: Option<String>,
    /// Heartbeat period (pool.heartbeat_interval), e.g. 1s. Default: 1s.
    #[arg(long)]
    pub heartbeat_interval: Option<String>,
    /// This node's failure domain (pool.failure_domain); wins over the node label
    /// (kubernetes.failure_domain_label).
    #[arg(long, env = "KVPOOL_FAILURE_DOMAIN")]
    pub failure_domain: Option<String>,
    /// TLS to the master (`--master-ca-file` and the like; not in the config file).
    #[command(flatten)]
    pub master_tls: kvpool_client::master::MasterTlsArgs,
    /// TLS on the transfer engine's TCP connections (pool.transport_tls): off, allow or
    /// require. Default: off.
    #[arg(long, value_name = "off|allow|require")]
    pub transfer_tls: Option<String>,
    /// This agent's transfer certificate chain, PEM (pool.transport_tls_cert_file).
    #[arg(long, value_name = "FILE")]
    pub transfer_tls_cert: Option<PathBuf>,
    /// Its private key, PEM (pool.transport_tls_key_file).
    #[arg(long, value_name = "FILE")]
    pub transfer_tls_key: Option<PathBuf>,
    /// CA certificates that verify other agents, PEM (pool.transport_tls_ca_file).
    #[arg(long, value_name = "FILE")]
    pub transfer_tls_ca: Option<PathBuf>,
    /// Name every target certificate must carry (pool.transport_tls_server_name).
    #[arg(long)]
    pub transfer_tls_server_name: Option<String>,
}

impl RunArgs {
    /// Overlay the flags on a file config.
    pub fn overlay(&self, mut file: FileConfig) -> FileConfig {
        fn set<T: Clone>(dst: &mut Option<T>, src: &Option<T>) {
            if let Some(v) = src {
                *dst = Some(v.clone());
            }
        }
        set(&mut file.node_name, &self.node_name);
        set(&mut file.discovery.sysfs_root, &self.sysfs_root);
        set(&mut file.discovery.procfs_root, &self.procfs_root);
        set(&mut file.dram.capacity, &self.dram_capacity);
        set(&mut file.dram.hugepages, &self.hugepages);
        if let Some(path) = &self.dram_persistence_path {
            let p = file.dram.persistence.get_or_insert_default();
            p.path = Some(path.clone());
            p.mode.get_or_insert(crate::config::PersistenceMode::Tmpfs);
        }
        set(&mut file.ssd.path, &self.ssd_path);
        set(&mut file.ssd.capacity, &self.ssd_capacity);
        set(&mut file.engine_api.socket_dir, &self.socket_dir);
        set(&mut file.engine_api.shm_dir, &self.shm_dir);
        set(&mut file.admin.listen, &self.admin_listen);
        if !self.master.is_empty() {
            file.pool.master = self.master.clone();
        }
        set(&mut file.pool.auth_key_file, &self.auth_key_file);
        set(&mut file.pool.transport_listen, &self.transport_listen);
        set(&mut file.pool.advertise_host, &self.advertise_host);
        set(&mut file.pool.heartbeat_interval, &self.heartbeat_interval);
        set(&mut file.pool.failure_domain, &self.failure_domain);
        set(&mut file.pool.transport_tls, &self.transfer_tls);
        set(
            &mut file.pool.transport_tls_cert_file,
            &self.transfer_tls_cert,
        );
        set(
            &mut file.pool.transport_tls_key_file,
            &self.transfer_tls_key,
        );
        set(&mut file.pool.transport_tls_ca_file, &self.transfer_tls_ca);
        set(
            &mut file.pool.transport_tls_server_name,
            &self.transfer_tls_server_name,
        );
        file
    }
}

/// Flags of `discover`.
#[derive(Debug, Args)]
pub struct DiscoverArgs {
    #[arg(long, default_value = "/sys")]
    pub sysfs_root: PathBuf,
    #[arg(long, default_value = "/proc")]
    pub procfs_root: PathBuf,
    /// Print only the node label/annotation summary.
    #[arg(long)]
    pub summary: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::FromArgMatches;

    /// `kvpool agent` as the binary mounts it: the subcommands under a bare command.
    fn agent() -> clap::Command {
        Command::augment_subcommands(clap::Command::new("agent"))
    }

    fn parse<const N: usize>(args: [&str; N]) -> Result<Command, clap::Error> {
        Command::from_arg_matches(&agent().try_get_matches_from(args)?)
    }

    #[test]
    fn cli_definition_is_consistent() {
        agent().debug_assert();
    }

    /// `run --help` states the defaults a flag leaves in place, and they are the ones the
    /// configuration really takes when neither the file nor the flag sets a field.
    #[test]
    fn run_help_states_the_defaults_the_config_takes() {
        let mut cmd = agent();
        let help = cmd
            .find_subcommand_mut("run")
            .expect("run")
            .render_long_help()
            .to_string();
        let defaults = crate::config::validate(&FileConfig::default()).expect("defaults");
        for (flag, stated, actual) in [
            (
                "--dram-capacity",
                "1GiB",
                (defaults.dram.capacity == 1 << 30),
            ),
            (
                "--socket-dir",
                "/run/kvpool",
                (defaults.api.socket_dir == std::path::Path::new("/run/kvpool")),
            ),
            (
                "--admin-listen",
                "0.0.0.0:9464",
                (defaults.admin_listen.to_string() == "0.0.0.0:9464"),
            ),
        ] {
            let section = help.split(flag).nth(1).expect(flag);
            let first = section.split("\n      --").next().unwrap_or_default();
            assert!(
                first.contains(&format!("Default: {stated}")),
                "{flag}: {first}"
            );
            assert!(actual, "{flag}: the config's default is not {stated}");
        }
    }

    #[test]
    fn container_args_parse_and_overlay() {
        let command = parse([
            "agent",
            "run",
            "--config",
            "/etc/kvpool/agent.yaml",
            "--dram-capacity",
            "8GiB",
            "--ssd-path",
            "/var/lib/kvpool",
        ])
        .expect("parse");
        let Command::Run(args) = command else {
            panic!("run expected");
        };
        let file = args.overlay(FileConfig::default());
        assert_eq!(file.dram.capacity, Some(ByteSize::gib(8)));
        assert_eq!(file.ssd.path, Some(PathBuf::from("/var/lib/kvpool")));
        assert!(parse(["agent", "run", "--dram-capacity", "lots"]).is_err());
    }
}
