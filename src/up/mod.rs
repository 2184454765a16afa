//! `kvpool up`: the whole of kvpool on one machine, with no cluster and no GPU. Starts a master,
//! K node agents in pool mode, P prefill and D decode synthetic engines that keep their KV blocks
//! in the agents, and a conductor in front of them, all on 127.0.0.1 as child processes (this
//! executable again, with the child's role as its first argument); waits until every one is
//! ready, prints the endpoints, then either waits for SIGTERM/SIGINT or replays a trace through
//! the conductor and prints a summary. Stops every child on the way out, also on errors.
//! I/O boundary: this module (runtime, signals, working directory); `settings` and `plan` are
//! pure but for locating this executable and free ports, `children` owns the processes,
//! `startup` starts and watches them, `replay` is the load generator and `summary` the report.

pub mod children;
pub mod plan;
pub mod progress;
pub mod replay;
mod settings;
pub mod shm;
mod startup;
pub mod stats;
pub mod summary;
pub mod vllm;
mod workdir;

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use self::children::{ChildError, Children};
use self::plan::Role;
use self::settings::{choose_ports, flag, random_key, validate};
pub use self::summary::{EngineKv, TIMED, metric_sum, metric_sum_labelled, summary_json};

/// Flags of `kvpool up`, each also read from `KVPOOL_UP_<FLAG>` (`KVPOOL_UP_AGENT_DRAM`, ...).
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// Node agents (each a `kvpool agent run` process with its own DRAM tier).
    #[arg(long, env = "KVPOOL_UP_AGENTS", default_value_t = 2)]
    pub agents: usize,
    /// Prefill engines (synthetic).
    #[arg(long, env = "KVPOOL_UP_PREFILL", default_value_t = 2)]
    pub prefill: usize,
    /// Decode engines (synthetic).
    #[arg(long, env = "KVPOOL_UP_DECODE", default_value_t = 2)]
    pub decode: usize,
    /// Port of the conductor's OpenAI-compatible API (0: any free port).
    #[arg(long, env = "KVPOOL_UP_PORT", default_value_t = 0)]
    pub port: u16,
    /// First of the consecutive ports for every other listener (0: free ports).
    #[arg(long, env = "KVPOOL_UP_BASE_PORT", default_value_t = 0)]
    pub base_port: u16,
    /// Working directory (configs, sockets, logs, key); default: a temporary directory that is
    /// removed at exit.
    #[arg(long, env = "KVPOOL_UP_DIR")]
    pub dir: Option<PathBuf>,
    /// DRAM tier of each agent.
    #[arg(long, env = "KVPOOL_UP_AGENT_DRAM", default_value = "64MiB")]
    pub agent_dram: String,
    /// Replicas of every block the engines put through the agents (the KVCachePool's
    /// `replication.replicas`).
    #[arg(long, env = "KVPOOL_UP_REPLICAS", default_value_t = 1)]
    pub replicas: u8,
    /// Failure domain of each agent, comma separated (agent i gets entry i modulo their
    /// number); the master then keeps the replicas of a block in distinct domains, as a
    /// KVCachePool's `replication.spreadLabelKey` does with a node label's values.
    #[arg(long, env = "KVPOOL_UP_AGENT_FAILURE_DOMAINS", value_delimiter = ',')]
    pub agent_failure_domains: Vec<String>,
    /// Eviction policy of the pool (the KVCachePool's `eviction.policy`).
    #[arg(long, env = "KVPOOL_UP_EVICTION_POLICY", value_enum,
        default_value_t = kvpool_core::master::PolicyKind::Lru)]
    pub eviction_policy: kvpool_core::master::PolicyKind,
    /// Tier usage, percent, at which eviction starts (`eviction.highWatermarkPercent`;
    /// default: the master's, 95).
    #[arg(long, env = "KVPOOL_UP_HIGH_WATERMARK_PERCENT")]
    pub high_watermark_percent: Option<u8>,
    /// Tier usage, percent, at which eviction stops (`eviction.lowWatermarkPercent`; default:
    /// the master's, 85).
    #[arg(long, env = "KVPOOL_UP_LOW_WATERMARK_PERCENT")]
    pub low_watermark_percent: Option<u8>,
    /// Keep each agent's DRAM tier in a /dev/shm directory so that a restarted agent finds its
    /// blocks: `auto` (a directory for this run, when /dev/shm is tmpfs), `keep` (with `--dir`:
    /// kept after exit for the next run with that directory) or `off`.
    #[arg(long, env = "KVPOOL_UP_AGENT_DRAM_PERSISTENCE", value_enum,
        default_value_t = shm::DramPersistence::Auto)]
    pub agent_dram_persistence: shm::DramPersistence,
    /// sysfs root the agents read their topology from (default: /sys).
    #[arg(long, env = "KVPOOL_UP_AGENT_SYSFS_ROOT")]
    pub agent_sysfs_root: Option<PathBuf>,
    /// procfs root the agents read memory sizes from (default: /proc).
    #[arg(long, env = "KVPOOL_UP_AGENT_PROCFS_ROOT")]
    pub agent_procfs_root: Option<PathBuf>,
    /// Model served: a name for the synthetic engines; with `--engine vllm`, the model's
    /// directory (served under its last path component).
    #[arg(long, env = "KVPOOL_UP_MODEL", default_value = "kvpool-synthetic")]
    pub model: String,
    /// The engines behind the conductor: `synthetic` (kvpool's own: no model, no GPU) or
    /// `vllm` (real `vllm serve` processes of the --model directory, with kvpool's KV
    /// connector on this pool; docs/up.md, "Real engines").
    #[arg(long, value_enum, default_value_t = UpEngine::Synthetic, env = "KVPOOL_UP_ENGINE")]
    pub engine: UpEngine,
    /// With `--engine vllm`: the Python that has vLLM and the kvpool package. Default:
    /// `.tools/vllm/bin/python` when it exists (scripts/engines.sh vllm), else `python3`.
    #[arg(long, env = "KVPOOL_UP_ENGINE_PYTHON")]
    pub engine_python: Option<PathBuf>,
    /// With `--engine vllm`: more `vllm serve` arguments for every engine, space-separated.
    #[arg(long, allow_hyphen_values = true, env = "KVPOOL_UP_ENGINE_ARGS")]
    pub engine_args: Option<String>,
    /// Tokens per KV block. Default: 512 with the synthetic engines (the Mooncake traces'
    /// block), 32 with `--engine vllm`.
    #[arg(long, env = "KVPOOL_UP_BLOCK_SIZE")]
    pub block_size: Option<u32>,
    /// KV bytes per token written by the engines (64: 32 KiB blocks of 512 tokens).
    #[arg(long, env = "KVPOOL_UP_KV_BYTES_PER_TOKEN", default_value_t = 64)]
    pub kv_bytes_per_token: u64,
    /// Engines' time scale (default: 1 / --speed, so the replay keeps the trace's load); the
    /// conductor gets it too, so that its clock runs in the engines' cost-model time.
    #[arg(long, env = "KVPOOL_UP_TIME_SCALE")]
    pub time_scale: Option<f64>,
    /// Disaggregation convention between the conductor and the engines: `vllm` (prefill, then
    /// decode) or `sglang` (both at once, the KV hand-off paired by a bootstrap room).
    #[arg(long, env = "KVPOOL_UP_ENGINE_PROTOCOL", value_enum,
        default_value_t = kvpool_proto::openai::EngineProtocol::Vllm)]
    pub engine_protocol: kvpool_proto::openai::EngineProtocol,
    /// The conductor's prefill placement policy (its `--policy`): `conductor` (the
    /// KVCache-centric one: lowest estimated TTFT counting engines' caches and the pool),
    /// `local-only`, `cache-aware`, `least-load`, `round-robin` or `random`; to compare them
    /// on one replay (docs/scheduling.md, "TTFT per policy on live vLLM engines").
    #[arg(long, env = "KVPOOL_UP_POLICY", value_enum,
        default_value_t = kvpool_core::sched::Policy::Conductor)]
    pub policy: kvpool_core::sched::Policy,
    /// Replay this Mooncake trace through the conductor, print a summary and exit.
    #[arg(long, env = "KVPOOL_UP_REPLAY", value_name = "TRACE")]
    pub replay: Option<PathBuf>,
    /// Replay only the first N requests.
    #[arg(long, env = "KVPOOL_UP_LIMIT", requires = "replay")]
    pub limit: Option<usize>,
    /// Replay this many times faster than the trace's timestamps.
    #[arg(long, env = "KVPOOL_UP_SPEED", default_value_t = 10.0)]
    pub speed: f64,
    /// Print the summary as JSON.
    #[arg(long, env = "KVPOOL_UP_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    pub json: bool,
    /// How long each child gets to exit after SIGTERM before SIGKILL (`--grace-s` is its old
    /// spelling).
    #[arg(long, env = "KVPOOL_UP_GRACE", alias = "grace-s", default_value = "10s",
        value_parser = kvpool_core::flags::parse_duration)]
    pub grace: Duration,
    /// How long to wait for every child to report ready (`--ready-timeout-s` is its old
    /// spelling).
    #[arg(long, env = "KVPOOL_UP_READY_TIMEOUT", alias = "ready-timeout-s", default_value = "2m",
        value_parser = kvpool_core::flags::parse_duration)]
    pub ready_timeout: Duration,
    /// Mutual TLS on the master's port and TLS on the transfer engines' TCP connections: a
    /// throw-away CA in the working directory issues the master a server certificate for
    /// 127.0.0.1/localhost and every other process a certificate of its own (agents one that
    /// serves their transfer target and identifies them to the master, the others a client
    /// certificate); the master requires client certificates of that CA, the agents serve and
    /// dial transfers with TLS (`--transfer-tls require`), and the ready line names the
    /// environment a user's client needs (`client_env`, a client certificate of its own). Off
    /// by default: every connection of `up` stays on loopback, where TLS protects nothing the
    /// user's account does not already.
    #[arg(long, env = "KVPOOL_UP_TLS", value_parser = clap::builder::BoolishValueParser::new())]
    pub tls: bool,
    /// Client API keys for the conductor (one per line): it answers requests without one of
    /// them with 401 (the conductor's `--api-key-file`; docs/openai.md, "API keys").
    #[arg(long, env = "KVPOOL_UP_API_KEY_FILE", value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
}

impl UpArgs {
    /// `--block-size`, or the engines' default.
    pub fn block_size(&self) -> u32 {
        self.block_size.unwrap_or(match self.engine {
            UpEngine::Synthetic => 512,
            UpEngine::Vllm => 32,
        })
    }
}

/// The engines `kvpool up` starts (`--engine`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum UpEngine {
    /// kvpool's synthetic engines.
    Synthetic,
    /// Real vLLM.
    Vllm,
}

/// Errors of `kvpool up`.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum UpError {
    #[error(transparent)]
    Flag(kvpool_core::flags::FlagError),
    #[error("cannot locate this kvpool binary")]
    SelfExe(#[source] std::io::Error),
    #[error("cannot prepare the working directory {path}")]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot find free ports")]
    Ports(#[source] kvpool_harness::HarnessError),
    #[error("cannot start the Tokio runtime")]
    Runtime(#[source] std::io::Error),
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
    #[error("starting children")]
    Child(#[source] ChildError),
    #[error("{name} exited during start-up ({status}); see {log}")]
    ChildExited {
        name: String,
        status: String,
        log: PathBuf,
    },
    #[error("{name} was not ready within {seconds} s; see {log}")]
    NotReady {
        name: String,
        seconds: f64,
        log: PathBuf,
    },
    #[error("cannot make the throw-away TLS certificates")]
    Tls(#[source] kvpool_harness::tls::TlsGenError),
    #[error("interrupted during start-up")]
    Interrupted,
    #[error("cannot read the trace")]
    Trace(#[source] kvpool_core::sim::trace::TraceError),
    #[error("children did not stop cleanly: {0}")]
    Unclean(String),
    #[error("{name} exited during the replay ({status}); the replay was stopped; see {log}")]
    ChildDied {
        name: String,
        status: String,
        log: PathBuf,
    },
    #[error("the replay was cut short by a signal: {sent} of {total} requests sent")]
    ReplayCut { sent: usize, total: usize },
}

kvpool_runtime::error_category!(UpError);

/// The pool key (for the master), each role's credential file derived from it, and each
/// agent's own node-bound one (0600 each, in the 0700 run directory).
fn write_keys(dir: &std::path::Path, pool_key: &str, agents: usize) -> Result<(), UpError> {
    use kvpool_client::credentials::{node_file, role_file};
    use kvpool_proto::auth::Role;
    let short = || flag("auth", "the generated pool key is too short");
    let mut files = vec![(plan::key_file(dir), pool_key.to_owned())];
    for role in [Role::Agent, Role::Engine, Role::Conductor, Role::Observer] {
        let text = role_file(pool_key.as_bytes(), role).ok_or_else(short)?;
        files.push((plan::role_key_file(dir, role), text));
    }
    for i in 0..agents {
        let text = node_file(pool_key.as_bytes(), &plan::agent_node(i)).ok_or_else(short)?;
        files.push((plan::agent_key_file(dir, i), text));
    }
    for (path, text) in files {
        kvpool_harness::tls::write_private(&path, &text)
            .map_err(|source| UpError::Dir { path, source })?;
    }
    Ok(())
}

/// The environment of a client outside `up` (a user's Python process) under `--tls`: the CA,
/// its own client certificate `cert` and `key`, transfer TLS to the agents.
fn client_tls_env(ca: &Path, cert: &Path, key: &Path) -> Vec<(String, String)> {
    use kvpool_client::master::{CA_FILE_ENV, CLIENT_CERT_FILE_ENV, CLIENT_KEY_FILE_ENV};
    use kvpool_client::pool::{TRANSFER_CA_FILE_ENV, TRANSFER_TLS_ENV};
    [
        (CA_FILE_ENV, ca),
        (CLIENT_CERT_FILE_ENV, cert),
        (CLIENT_KEY_FILE_ENV, key),
        (TRANSFER_CA_FILE_ENV, ca),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.display().to_string()))
    .chain(std::iter::once((
        TRANSFER_TLS_ENV.to_owned(),
        "require".to_owned(),
    )))
    .collect()
}

/// The names `up`'s certificates carry: every process listens on loopback.
const TLS_NAMES: &[&str] = &["127.0.0.1", "localhost"];

/// `--tls`: a certificate of the run's CA for every child but the master, its own: agents a
/// server-and-client one (their transfer target serves it, their master calls show it), the
/// others a client one for their master calls (`KVPOOL_MASTER_CLIENT_CERT_FILE` and
/// `KVPOOL_MASTER_CLIENT_KEY_FILE` in their environment).
fn tls_per_child(
    ca: &kvpool_harness::tls::ThrowawayCa,
    specs: &mut [plan::ChildSpec],
) -> Result<(), kvpool_harness::tls::TlsGenError> {
    use kvpool_client::master::{CLIENT_CERT_FILE_ENV, CLIENT_KEY_FILE_ENV};
    use kvpool_harness::tls::Usage;
    for spec in specs.iter_mut().filter(|s| s.role != plan::Role::Master) {
        let name = format!("kvpool {}", spec.name);
        let (cert, key) = if spec.role == plan::Role::Agent {
            let (cert, key) = ca.issue(&spec.name, &name, TLS_NAMES, Usage::Both)?;
            spec.args.extend([
                "--transfer-tls-cert".to_owned(),
                cert.display().to_string(),
                "--transfer-tls-key".to_owned(),
                key.display().to_string(),
            ]);
            (cert, key)
        } else {
            ca.issue(&spec.name, &name, &[], Usage::Client)?
        };
        spec.env.extend([
            (CLIENT_CERT_FILE_ENV.to_owned(), cert.display().to_string()),
            (CLIENT_KEY_FILE_ENV.to_owned(), key.display().to_string()),
        ]);
    }
    Ok(())
}

/// Entry point of `kvpool up`.
pub fn run(args: &UpArgs) -> Result<(), UpError> {
    // Trace first: a bad file fails before anything starts.
    let records = match &args.replay {
        Some(path) => {
            // Real engines replay the trace scaled block for block (each 512-token trace block
            // becomes one engine block); the synthetic ones replay it as it is.
            let trace_block = match args.engine {
                UpEngine::Synthetic => args.block_size(),
                UpEngine::Vllm => vllm::TRACE_BLOCK_TOKENS as u32,
            };
            let mut r = kvpool_core::sim::trace::load(path, trace_block).map_err(UpError::Trace)?;
            if let Some(n) = args.limit {
                r.truncate(n);
            }
            if args.engine == UpEngine::Vllm {
                r = r
                    .into_iter()
                    .map(|rec| vllm::scale_record(rec, args.block_size()))
                    .collect();
            }
            Some(r)
        }
        None => None,
    };
    let (dir, temp) = workdir::work_dir(args)?;
    let (tiers, _tiers_guard) = shm::tier_dir(args.agent_dram_persistence, &dir, temp.is_some())?;
    let _temp = temp;
    let mut settings = validate(args, dir.clone(), tiers)?;
    let tls_ca = if args.tls {
        let ca = kvpool_harness::tls::ThrowawayCa::create(&dir, "kvpool up throw-away CA");
        Some(ca.map_err(UpError::Tls)?)
    } else {
        None
    };
    let mut master_tls = kvpool_client::master::MasterTls::default();
    let mut client_env = Vec::new();
    if let Some(ca) = &tls_ca {
        use kvpool_harness::tls::Usage;
        let (cert, key) = ca
            .issue("master", "kvpool master", TLS_NAMES, Usage::Server)
            .map_err(UpError::Tls)?;
        // Mutual TLS: every client of the master shows a certificate of the run's CA, each
        // process its own (`tls_per_child`).
        settings.master_flags.extend([
            "--tls-cert-file".to_owned(),
            cert.display().to_string(),
            "--tls-key-file".to_owned(),
            key.display().to_string(),
            "--tls-client-ca-file".to_owned(),
            ca.ca.display().to_string(),
        ]);
        let (cert, key) = ca
            .issue("user", "kvpool up user", &[], Usage::Client)
            .map_err(UpError::Tls)?;
        client_env = client_tls_env(&ca.ca, &cert, &key);
        let (cert, key) = ca
            .issue("up", "kvpool up", &[], Usage::Client)
            .map_err(UpError::Tls)?;
        master_tls.ca_file = Some(ca.ca.clone());
        master_tls.cert_file = Some(cert);
        master_tls.key_file = Some(key);
        settings.agent_flags.extend([
            "--transfer-tls".to_owned(),
            "require".to_owned(),
            "--transfer-tls-ca".to_owned(),
            ca.ca.display().to_string(),
        ]);
    }
    let ports = choose_ports(
        plan::ports_needed(&settings),
        args.base_port,
        args.port,
        settings.vllm.is_some(),
    )?;
    let mut specs =
        plan::plan(&settings, &ports).ok_or_else(|| flag("base-port", "too few ports"))?;
    if let Some(ca) = &tls_ca {
        tls_per_child(ca, &mut specs).map_err(UpError::Tls)?;
    }
    if let Some(keys) = &args.api_key_file {
        // Checked here, so that a bad file fails before anything starts.
        kvpool_conductor::server::read_keys(keys)
            .map_err(|e| flag("api-key-file", e.to_string()))?;
        let path = std::path::absolute(keys).unwrap_or_else(|_| keys.clone());
        for spec in specs.iter_mut().filter(|s| s.role == plan::Role::Conductor) {
            spec.args
                .extend(["--api-key-file".to_owned(), path.display().to_string()]);
        }
    }
    write_keys(&dir, &random_key(), settings.agents)?;
    tracing::info!(
        dir = %dir.display(),
        children = specs.len(),
        agents = settings.agents,
        prefill = settings.prefill,
        decode = settings.decode,
        model = %settings.model,
        block_size = settings.block_size,
        agent_dram = %settings.agent_dram,
        time_scale = settings.time_scale,
        policy = settings.policy.name(),
        protocol = <&str>::from(settings.protocol),
        engine = if settings.vllm.is_some() { "vllm" } else { "synthetic" },
        replay = records.as_ref().map(Vec::len),
        tls = args.tls,
        "kvpool up: starting"
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(UpError::Runtime)?;
    let grace = args.grace;
    let mut children = Children::new(dir.join("logs"), grace);
    if let Some(ca) = &master_tls.ca_file {
        children.set_env(kvpool_client::master::CA_FILE_ENV, ca.clone());
        // Children with a transfer engine of their own dial the agents over TLS too.
        children.set_env(kvpool_client::pool::TRANSFER_TLS_ENV, "require".into());
        children.set_env(kvpool_client::pool::TRANSFER_CA_FILE_ENV, ca.clone());
    }
    let result = runtime.block_on(async {
        let stop = CancellationToken::new();
        kvpool_runtime::shutdown::cancel_on_signal(stop.clone()).map_err(UpError::Signals)?;
        let timeout = args.ready_timeout;
        startup::start_all(&mut children, &specs, timeout, &stop).await?;
        startup::print_ready(args.json, records.is_some(), &specs, &dir, &client_env);
        let Some(records) = &records else {
            if !args.json {
                println!("press Ctrl-C (or send SIGTERM) to stop");
            }
            startup::serve(&mut children, &stop).await;
            return Ok(None);
        };
        // A child that dies stops the replay (what it measures is no longer the pool).
        let replay_stop = stop.child_token();
        let conductor = startup::endpoint(&specs, Role::Conductor);
        let progress = std::sync::Arc::new(progress::Progress::new(records.len(), args.json));
        let shown = progress.clone();
        let on_done: replay::OnDone = std::sync::Arc::new(move |o| shown.record(o));
        let replay = replay::replay(
            &conductor,
            &settings.model,
            records,
            settings.block_size,
            settings.chunk_bytes,
            args.speed,
            &replay_stop,
            &on_done,
        );
        let (stats, died) = startup::watch(&mut children, replay, &replay_stop).await;
        progress.clear();
        let kv = summary::engine_kv(&specs).await;
        let observer = plan::role_key_file(&dir, kvpool_proto::auth::Role::Observer);
        let master = startup::endpoint(&specs, Role::Master);
        let pool = summary::pool_stats(&master, &observer, master_tls.clone()).await;
        let ended = match died {
            Some((name, status)) => Some(UpError::ChildDied {
                log: children.log_path(&name),
                name,
                status,
            }),
            None if stats.requests < records.len() => Some(UpError::ReplayCut {
                sent: stats.requests,
                total: records.len(),
            }),
            None => None,
        };
        Ok(Some((stats, kv, pool, ended)))
    });
    let stopped = children.stop_all();
    let unclean = startup::unclean(&stopped);
    if let Some(bad) = &unclean {
        tracing::warn!(children = %bad, logs = %dir.join("logs").display(), "unclean stop");
    }
    let mut ended = None;
    match result? {
        Some((stats, kv, pool, end)) => {
            ended = end;
            let policy = args.policy.name();
            let v = summary_json(&stats, args.speed, policy, &kv, pool, unclean.is_none());
            if args.json {
                println!("{v}");
            } else {
                summary::print_summary(&v, &stats, &kv);
                println!(
                    "all children stopped{}",
                    if unclean.is_none() {
                        " cleanly"
                    } else {
                        " (see warnings)"
                    }
                );
            }
        }
        None => {
            if !args.json {
                println!("all children stopped");
            }
        }
    }
    // The replay's own failure first: it says why the children stopped as they did.
    match (ended, unclean) {
        (Some(e), _) => Err(e),
        (None, Some(bad)) => Err(UpError::Unclean(bad)),
        (None, None) => Ok(()),
    }
}
