//! The flags of a process's master client TLS (`--master-ca-file` and the like), shared by the
//! processes that talk to the master (`kvpool agent run`, `kvpool conductor`): each flag also
//! reads the `KVPOOL_MASTER_*` variable that [`MasterTls::from_env`] reads, so either works
//! and a flag wins over its variable. Behind the `clap` feature. I/O boundary: none (the
//! files are read when a client is made).

use std::path::PathBuf;

use super::tls::MasterTls;

/// TLS to the master, as flags (flatten into a process's arguments).
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct MasterTlsArgs {
    /// CA certificates (PEM) that verify the master; set, every call to the master goes over
    /// TLS.
    #[arg(long, env = "KVPOOL_MASTER_CA_FILE", value_name = "FILE")]
    pub master_ca_file: Option<PathBuf>,
    /// Client certificate chain (PEM) shown to a master that requires mutual TLS; needs
    /// --master-client-key.
    #[arg(
        long,
        env = "KVPOOL_MASTER_CLIENT_CERT_FILE",
        value_name = "FILE",
        requires = "master_client_key"
    )]
    pub master_client_cert: Option<PathBuf>,
    /// Private key (PEM) of --master-client-cert.
    #[arg(
        long,
        env = "KVPOOL_MASTER_CLIENT_KEY_FILE",
        value_name = "FILE",
        requires = "master_client_cert"
    )]
    pub master_client_key: Option<PathBuf>,
    /// The name the master's certificate must carry (default: the host of the master
    /// address).
    #[arg(long, env = "KVPOOL_MASTER_SERVER_NAME", value_name = "NAME")]
    pub master_server_name: Option<String>,
}

impl MasterTlsArgs {
    /// The client settings these flags make (empty values count as unset, as in the
    /// environment).
    pub fn tls(&self) -> MasterTls {
        let path = |p: &Option<PathBuf>| p.clone().filter(|p| !p.as_os_str().is_empty());
        MasterTls {
            ca_file: path(&self.master_ca_file),
            cert_file: path(&self.master_client_cert),
            key_file: path(&self.master_client_key),
            server_name: self.master_server_name.clone().filter(|n| !n.is_empty()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        tls: MasterTlsArgs,
    }

    #[test]
    fn flags_make_the_client_settings_and_certificate_and_key_go_together() {
        let cli = Cli::try_parse_from([
            "p",
            "--master-ca-file",
            "/etc/ca.pem",
            "--master-client-cert",
            "/etc/c.pem",
            "--master-client-key",
            "/etc/k.pem",
            "--master-server-name",
            "master.pool",
        ])
        .expect("parse");
        assert_eq!(
            cli.tls.tls(),
            MasterTls {
                ca_file: Some("/etc/ca.pem".into()),
                cert_file: Some("/etc/c.pem".into()),
                key_file: Some("/etc/k.pem".into()),
                server_name: Some("master.pool".into()),
            }
        );
        let e = Cli::try_parse_from(["p", "--master-client-cert", "/etc/c.pem"])
            .expect_err("a certificate without its key");
        assert!(e.to_string().contains("--master-client-key"), "{e}");
    }
}
