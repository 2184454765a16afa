//! `kvpool auth ...`: credential files for deployments without the operator or `kvpool up`
//! (docs/install.md, "Credentials"). I/O boundary: reading the pool key file, writing the role
//! file (mode 0600) or standard output.

use std::path::PathBuf;

use anyhow::Context;
use kvpool_proto::auth::Role;

/// `kvpool auth` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum AuthCommand {
    /// Derive a role's credential file (agent, engine, conductor, observer) from the pool key
    /// file: each process then holds only its role's keys (docs/reliability.md, "Credentials").
    Derive(DeriveArgs),
}

/// `kvpool auth derive`.
#[derive(clap::Args, Debug)]
pub struct DeriveArgs {
    /// The role: agent, engine, conductor or observer (admin is the pool key file itself).
    #[arg(long, value_parser = parse_role)]
    pub role: Role,
    /// The pool key file (the master's `--auth-key-file`).
    #[arg(long)]
    pub auth_key_file: PathBuf,
    /// Bind an agent's credential to this node (its `node_name`): it can mount, unmount,
    /// heartbeat and adopt for that node only. Masters refuse node-less agent credentials for
    /// those calls unless run with --shared-agent-credentials.
    #[arg(long)]
    pub node: Option<String>,
    /// Write the credential file here (created with mode 0600) instead of standard output.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

fn parse_role(s: &str) -> Result<Role, String> {
    match Role::from_name(s) {
        Some(Role::Admin) => Err("admin's key file is the pool key file itself".into()),
        Some(r) => Ok(r),
        None => Err(format!(
            "unknown role {s:?}: one of agent, engine, conductor, observer"
        )),
    }
}

/// The credential file of `args.role`, as text.
pub fn derive(args: &DeriveArgs) -> anyhow::Result<String> {
    let pool = std::fs::read(&args.auth_key_file)
        .with_context(|| format!("reading {}", args.auth_key_file.display()))?;
    if kvpool_proto::auth::RoleDocument::looks_like(&pool) {
        anyhow::bail!(
            "{} is a role credential file, not the pool key",
            args.auth_key_file.display()
        );
    }
    let short = || format!("{} holds fewer than 16 bytes", args.auth_key_file.display());
    match &args.node {
        None => kvpool_client::credentials::role_file(&pool, args.role).with_context(short),
        Some(_) if args.role != Role::Agent => {
            anyhow::bail!("--node binds agent credentials only, not {}", args.role)
        }
        Some(node) if !kvpool_proto::auth::valid_node(node) => anyhow::bail!(
            "--node {node:?} is not a node name (1 to {} bytes, no control characters)",
            kvpool_proto::auth::MAX_NODE_LEN
        ),
        Some(node) => kvpool_client::credentials::node_file(&pool, node).with_context(short),
    }
}

/// Run one `kvpool auth` subcommand.
pub fn run(cmd: &AuthCommand) -> anyhow::Result<()> {
    match cmd {
        AuthCommand::Derive(args) => {
            let text = derive(args)?;
            match &args.out {
                None => print!("{text}"),
                Some(path) => {
                    use std::io::Write as _;
                    use std::os::unix::fs::OpenOptionsExt;
                    let mut f = std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(0o600)
                        .open(path)
                        .with_context(|| format!("creating {}", path.display()))?;
                    f.write_all(text.as_bytes())
                        .with_context(|| format!("writing {}", path.display()))?;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derive_makes_a_role_file_from_the_pool_key_and_refuses_the_rest() {
        let dir = tempfile::tempdir().expect("tmp");
        let pool = dir.path().join("auth.key");
        std::fs::write(&pool, "0123456789abcdef0123456789abcdef\n").expect("write");
        let out = dir.path().join("engine.json");
        let args = DeriveArgs {
            role: Role::Engine,
            auth_key_file: pool.clone(),
            node: None,
            out: Some(out.clone()),
        };
        run(&AuthCommand::Derive(args)).expect("derive");
        let key = kvpool_proto::auth::AuthKey::from_file(&out).expect("role file");
        assert_eq!(key.role(), Role::Engine);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&out).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // From a role file, or a short key: a clear error.
        for (file, needle) in [(&out, "not the pool key"), (&pool, "fewer than 16")] {
            if file == &pool {
                std::fs::write(&pool, "short").expect("write");
            }
            let args = DeriveArgs {
                role: Role::Agent,
                auth_key_file: file.clone(),
                node: None,
                out: None,
            };
            let e = derive(&args).expect_err("refused");
            assert!(format!("{e:#}").contains(needle), "{e:#}");
        }
        assert!(parse_role("admin").is_err() && parse_role("root").is_err());
        // --node binds an agent's file to its node, and only an agent's.
        std::fs::write(&pool, "0123456789abcdef0123456789abcdef\n").expect("write");
        let node_args = |role, node: &str| DeriveArgs {
            role,
            auth_key_file: pool.clone(),
            node: Some(node.to_owned()),
            out: None,
        };
        let text = derive(&node_args(Role::Agent, "gpu-7.example")).expect("agent of a node");
        let doc = kvpool_proto::auth::RoleDocument::parse(text.as_bytes()).expect("document");
        assert_eq!(doc.node.as_deref(), Some("gpu-7.example"));
        for (role, node, needle) in [
            (Role::Engine, "gpu-7", "agent credentials only"),
            (Role::Agent, "", "not a node name"),
        ] {
            let e = derive(&node_args(role, node)).expect_err("refused");
            assert!(format!("{e:#}").contains(needle), "{e:#}");
        }
        assert_eq!(parse_role("conductor"), Ok(Role::Conductor));
    }
}
