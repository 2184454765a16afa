//! The flags of `kvpool operator ...` (clap derive, every flag also read from the environment).
//! I/O boundary: none; parsing only. Public so that packaging tests parse the chart's container
//! args with exactly the parser the binary uses.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Subcommand};

/// Default image tag: the operator's own version, so one chart release pins one set of images.
pub const DEFAULT_IMAGE_TAG: &str = env!("CARGO_PKG_VERSION");

/// Subcommands of `kvpool operator`.
// Parsed once at start-up; boxing `RunArgs` would only make matching on it clumsier.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the controllers until SIGTERM/SIGINT.
    Run(RunArgs),
    /// Write the CustomResourceDefinition YAML files (one per kind) and exit.
    Crd(CrdArgs),
    /// Copy the kvpool Python package this image carries into a directory and exit (the init
    /// container of every engine pod runs it).
    InstallPython(InstallPythonArgs),
}

/// Flags of `kvpool operator run`.
#[derive(Clone, Debug, Args)]
pub struct RunArgs {
    /// Namespace to watch; empty or absent means all namespaces.
    #[arg(long, env = "KVPOOL_WATCH_NAMESPACE", default_value = "")]
    pub namespace: String,
    /// Address of the admin server (/livez, /readyz, /metrics); `--admin-addr` and
    /// `KVPOOL_ADMIN_ADDR` are its old spellings.
    #[arg(
        long = "admin-listen",
        alias = "admin-addr",
        env = "KVPOOL_OPERATOR_ADMIN_LISTEN",
        default_value = "0.0.0.0:9090"
    )]
    pub admin_addr: SocketAddr,
    /// Take part in leader election through a coordination.k8s.io Lease; only the holder
    /// reconciles. Needed when the operator runs with more than one replica.
    #[arg(long, env = "KVPOOL_LEADER_ELECT", default_value_t = false)]
    pub leader_elect: bool,
    /// Name of the leader-election Lease.
    #[arg(
        long,
        env = "KVPOOL_LEADER_ELECTION_LEASE",
        default_value = "kvpool-operator"
    )]
    pub leader_election_lease: String,
    /// Namespace of the leader-election Lease (normally the operator's own namespace).
    #[arg(
        long,
        env = "KVPOOL_LEADER_ELECTION_NAMESPACE",
        default_value = "kvpool-system"
    )]
    pub leader_election_namespace: String,
    /// Identity in the Lease; defaults to the pod name (POD_NAME) or the host name.
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Field manager of every server-side apply and create (one per binary, so that ownership
    /// of fields is clear in `managedFields`).
    #[arg(long, env = "KVPOOL_FIELD_MANAGER", default_value = crate::labels::FIELD_MANAGER)]
    pub field_manager: String,
    /// The namespace this operator runs in (the chart passes the pod's own, from the downward
    /// API): pool NetworkPolicies admit the operator's pods from there only. Empty: from any
    /// namespace.
    #[arg(long, env = "POD_NAMESPACE", default_value = "")]
    pub operator_namespace: String,
    /// Default image of the node agent DaemonSet (a KVCachePool may override it).
    #[arg(long, env = "KVPOOL_AGENT_IMAGE", default_value_t = default_image("kvpool-agent"))]
    pub agent_image: String,
    /// Default image of the master (the `kvpool` CLI image).
    #[arg(long, env = "KVPOOL_MASTER_IMAGE", default_value_t = default_image("kvpool"))]
    pub master_image: String,
    /// Default image of the conductor (the `kvpool` CLI image).
    #[arg(long, env = "KVPOOL_CONDUCTOR_IMAGE", default_value_t = default_image("kvpool"))]
    pub conductor_image: String,
    /// Most reconciles running at once per controller (0 = unbounded is refused).
    #[arg(long, env = "KVPOOL_CONCURRENCY", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..))]
    pub concurrency: u16,
    /// Longest time from SIGTERM/SIGINT to exit, whatever the API server does (stopping the
    /// controllers and releasing the lease included); keep it inside the pod's termination
    /// grace period (30 s by default).
    #[arg(long, env = "KVPOOL_SHUTDOWN_TIMEOUT", default_value = "20s", value_parser = humantime::parse_duration)]
    pub shutdown_timeout: std::time::Duration,
    /// File holding the operator's root key (at least 32 bytes, e.g. `openssl rand -hex 32`):
    /// every pool's key is derived from it, so the operator never reads a Secret back
    /// (docs/adr/0008-operator-root-key.md).
    #[arg(
        long,
        env = "KVPOOL_OPERATOR_ROOT_KEY_FILE",
        required_unless_present = "root_key_secret",
        conflicts_with = "root_key_secret"
    )]
    pub root_key_file: Option<PathBuf>,
    /// Keep the root key in this Secret of the operator's own namespace (`POD_NAMESPACE`)
    /// instead of a file: read at start, and created with a random key when absent, so that
    /// installing needs no step before it (the chart's default).
    #[arg(long, env = "KVPOOL_OPERATOR_ROOT_KEY_SECRET")]
    pub root_key_secret: Option<String>,
    /// CA certificates (PEM) that verify the masters of pools with `spec.master.tls`, for the
    /// operator's usage query. Without it such a pool's usage is not read (`no_master_ca`).
    #[arg(long, env = "KVPOOL_OPERATOR_MASTER_CA_FILE")]
    pub master_ca_file: Option<PathBuf>,
    /// URL the node agents reach this operator's agent credential issuer at
    /// (`https://<service>.<namespace>.svc:8443`; the chart sets it). With it each agent gets
    /// its own node's credential on proof of its pod, and masters refuse an agent's calls for
    /// other nodes; without it the agents share one credential file and masters run with
    /// `--shared-agent-credentials` (docs/adr/0009-node-bound-agent-credentials.md).
    #[arg(long, env = "KVPOOL_OPERATOR_AGENT_ISSUER_URL")]
    pub agent_issuer_url: Option<String>,
    /// Listen address of the agent credential issuer (HTTPS), with `--agent-issuer-url`.
    #[arg(
        long,
        env = "KVPOOL_OPERATOR_AGENT_ISSUER_LISTEN",
        default_value = "0.0.0.0:8443"
    )]
    pub agent_issuer_listen: SocketAddr,
}

/// Flags of `kvpool operator crd`.
#[derive(Clone, Debug, Args)]
pub struct CrdArgs {
    /// Directory to write one `<plural>.kvpool.dev.yaml` file per kind into; without it the
    /// documents go to stdout separated by `---`.
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
}

/// Flags of `kvpool operator install-python`.
#[derive(Clone, Debug, Args)]
pub struct InstallPythonArgs {
    /// The installed package tree (`pip install --target` output) inside the image.
    #[arg(long, default_value = crate::contract::PYTHON_PACKAGE_DIR)]
    pub from: PathBuf,
    /// Directory to copy it into (the engine pod's shared volume); created if absent.
    #[arg(long)]
    pub to: PathBuf,
}

fn default_image(name: &str) -> String {
    format!("ghcr.io/kvpool/{name}:{DEFAULT_IMAGE_TAG}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::FromArgMatches;

    /// `kvpool operator` as the binary mounts it: these subcommands under a parent command.
    fn operator() -> clap::Command {
        Command::augment_subcommands(clap::Command::new("operator")).subcommand_required(true)
    }

    /// Parses `argv` (the parent command's name first) as the binary does.
    fn parse<I, T>(argv: I) -> Result<Command, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        Command::from_arg_matches(&operator().try_get_matches_from(argv)?)
    }

    #[test]
    fn cli_definition_is_consistent() {
        operator().debug_assert();
    }

    #[test]
    fn run_defaults_watch_all_namespaces_without_leader_election() {
        let cli = parse(["operator", "run", "--root-key-file", "/k"]).expect("parse");
        let Command::Run(args) = cli else {
            panic!("expected run");
        };
        assert_eq!(args.namespace, "");
        assert!(!args.leader_elect);
        assert_eq!(args.admin_addr.port(), 9090);
        assert!(args.agent_image.starts_with("ghcr.io/kvpool/kvpool-agent:"));
        assert_eq!(args.field_manager, "kvpool-operator");
        assert_eq!(args.root_key_file, Some(PathBuf::from("/k")));
    }

    #[test]
    fn run_requires_the_root_key_file_or_secret_but_not_both() {
        let e = parse(["operator", "run"]).expect_err("no root key");
        assert!(e.to_string().contains("--root-key-file"), "{e}");
        let cli = parse(["operator", "run", "--root-key-secret", "k"]).expect("secret");
        let Command::Run(args) = cli else {
            panic!("expected run");
        };
        assert_eq!(args.root_key_secret.as_deref(), Some("k"));
        let both = [
            "operator",
            "run",
            "--root-key-file",
            "/k",
            "--root-key-secret",
            "k",
        ];
        assert!(parse(both).is_err());
    }

    #[test]
    fn run_rejects_zero_concurrency_and_bad_addresses() {
        assert!(parse(["operator", "run", "--concurrency", "0"]).is_err());
        assert!(parse(["operator", "run", "--admin-listen", "nope"]).is_err());
    }

    #[test]
    fn crd_takes_an_output_directory() {
        let cli = parse(["operator", "crd", "--out-dir", "crds/"]).expect("parse");
        let Command::Crd(args) = cli else {
            panic!("expected crd");
        };
        assert_eq!(args.out_dir, Some(PathBuf::from("crds/")));
    }

    #[test]
    fn install_python_takes_the_operator_generated_args() {
        let argv = crate::contract::install_python_args();
        let cli = parse(argv).expect("parse");
        let Command::InstallPython(args) = cli else {
            panic!("expected install-python");
        };
        assert_eq!(
            args.from,
            PathBuf::from(crate::contract::PYTHON_PACKAGE_DIR)
        );
        assert_eq!(args.to, PathBuf::from(crate::contract::PYTHON_STAGING_DIR));
        let cli = parse(["operator", "install-python", "--to", "/x"]).expect("parse");
        let Command::InstallPython(args) = cli else {
            panic!("expected install-python");
        };
        assert_eq!(args.from, PathBuf::from("/opt/kvpool/python"));
        assert!(parse(["operator", "install-python"]).is_err());
    }
}
