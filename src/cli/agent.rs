//! `kvpool agent ...`: the node agent run by the KVCachePool DaemonSet. Thin: load and validate
//! the configuration, then dispatch into `kvpool_agent`.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use kvpool_agent::cli::{Command, RunArgs};
use kvpool_agent::config::{self, AgentConfig, FileConfig};
use kvpool_agent::discovery::{self, Roots};
use kvpool_agent::pool::Member;
use kvpool_agent::registrar::LocalRegistrar;
use kvpool_agent::runtime::{self, Mode};

fn load(args: &RunArgs) -> anyhow::Result<AgentConfig> {
    let file = match (&args.config, &args.pool_config) {
        (Some(path), _) => config::load_file(path)?,
        (None, Some(path)) => {
            let procfs = args.procfs_root.clone().unwrap_or(Roots::default().procfs);
            config::load_pool_document(path, &procfs)?
        }
        (None, None) => FileConfig::default(),
    };
    let mut cfg = config::validate(&args.overlay(file))?;
    if let Some(pool) = &mut cfg.pool {
        pool.master_tls = args.master_tls.tls();
    }
    Ok(cfg)
}

/// Run one `kvpool agent` subcommand.
pub fn run(cmd: Command) -> anyhow::Result<()> {
    match cmd {
        Command::Run(args) => {
            let cfg = load(&args)?;
            let rt = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
            // Signal handlers and the pool link spawn tasks: they need the runtime entered.
            let _entered = rt.enter();
            let shutdown = CancellationToken::new();
            kvpool_runtime::shutdown::cancel_on_signal(shutdown.clone())
                .context("installing signal handlers")?;
            let registry = prometheus::Registry::new();
            match cfg.pool.clone() {
                None => {
                    let mode = Mode::Local(Arc::new(LocalRegistrar::new()));
                    runtime::run_blocking(&rt, cfg, mode, registry, shutdown)?;
                }
                Some(pool) => {
                    let issued = match &pool.credential_issuer {
                        Some(issuer) => Some(
                            rt.block_on(kvpool_agent::issuer::fetch(issuer, &shutdown))
                                .context("getting this node's credential from the operator")?,
                        ),
                        None => None,
                    };
                    let member = Member::start(&pool, &cfg.node_name, &registry, issued.as_deref())
                        .context("joining the pool")?;
                    // The runtime runs the link (mounts, heartbeats, tasks) and unmounts before
                    // withdrawing the memory; the transfer target closes last.
                    let ran =
                        runtime::run_blocking(&rt, cfg, Mode::Pool(&member), registry, shutdown);
                    drop(member);
                    ran?;
                }
            }
        }
        Command::CheckConfig(args) => {
            let cfg = load(&args)?;
            println!("{cfg:#?}");
        }
        Command::Discover(args) => {
            let roots = Roots {
                sysfs: args.sysfs_root,
                procfs: args.procfs_root,
            };
            let env: BTreeMap<String, String> = std::env::vars().collect();
            #[allow(unused_mut)]
            let mut topo = discovery::discover(&roots, &env)?;
            #[cfg(feature = "cuda")]
            kvpool_agent::gpu_cuda::enrich(&mut topo);
            let out = if args.summary {
                serde_json::to_string_pretty(&kvpool_agent::topology::summarize(&topo))?
            } else {
                serde_json::to_string_pretty(&topo)?
            };
            println!("{out}");
        }
    }
    Ok(())
}
