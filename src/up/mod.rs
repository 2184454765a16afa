//! `kvpool up`: the whole of kvpool on one machine, with no cluster and no GPU. Starts a master,
//! K node agents in pool mode, P prefill and D decode synthetic engines that keep their KV blocks
//! in the agents, and a conductor in front of them, all on 127.0.0.1 as child processes (this
//! executable again, with the child's role as its first argument); waits until every one is
//! ready, prints the endpoints, then either waits for SIGTERM/SIGINT or replays a trace through
//! the conductor and prints a summary. Stops every child on the way out, also on errors.
//! I/O boundary: this module (runtime, signals, HTTP probes, the master's stats); `plan` is pure,
//! `children` owns the processes, `replay` the load generator.

pub mod children;
pub mod plan;
pub mod replay;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use axum::body::Body;
use futures::StreamExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use self::children::{ChildError, Children, Stopped};
use self::plan::{ChildSpec, Role, UpSettings};
use self::replay::ReplayStats;

/// Flags of `kvpool up`.
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// Node agents (each a `kvpool agent run` process with its own DRAM tier).
    #[arg(long, default_value_t = 2)]
    pub agents: usize,
    /// Prefill engines (synthetic).
    #[arg(long, default_value_t = 2)]
    pub prefill: usize,
    /// Decode engines (synthetic).
    #[arg(long, default_value_t = 2)]
    pub decode: usize,
    /// Port of the conductor's OpenAI-compatible API (0: any free port).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// First of the consecutive ports for every other listener (0: free ports).
    #[arg(long, default_value_t = 0)]
    pub base_port: u16,
    /// Working directory (configs, sockets, logs, key); default: a temporary directory that is
    /// removed at exit.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// DRAM tier of each agent.
    #[arg(long, default_value = "64MiB")]
    pub agent_dram: String,
    /// sysfs root the agents read their topology from (default: /sys).
    #[arg(long)]
    pub agent_sysfs_root: Option<PathBuf>,
    /// procfs root the agents read memory sizes from (default: /proc).
    #[arg(long)]
    pub agent_procfs_root: Option<PathBuf>,
    /// Model name served.
    #[arg(long, default_value = "kvpool-synthetic")]
    pub model: String,
    /// Tokens per KV block (the Mooncake traces use 512).
    #[arg(long, default_value_t = 512)]
    pub block_size: u32,
    /// KV bytes per token written by the engines (64: 32 KiB blocks of 512 tokens).
    #[arg(long, default_value_t = 64)]
    pub kv_bytes_per_token: u64,
    /// Engines' time scale (default: 1 / --speed, so the replay keeps the trace's load); the
    /// conductor gets it too, so that its clock runs in the engines' cost-model time.
    #[arg(long)]
    pub time_scale: Option<f64>,
    /// Disaggregation convention between the conductor and the engines: `vllm` (prefill, then
    /// decode) or `sglang` (both at once, the KV hand-off paired by a bootstrap room).
    #[arg(long, value_enum, default_value_t = kvpool_proto::openai::EngineProtocol::Vllm)]
    pub engine_protocol: kvpool_proto::openai::EngineProtocol,
    /// Replay this Mooncake trace through the conductor, print a summary and exit.
    #[arg(long, value_name = "TRACE")]
    pub replay: Option<PathBuf>,
    /// Replay only the first N requests.
    #[arg(long, requires = "replay")]
    pub limit: Option<usize>,
    /// Replay this many times faster than the trace's timestamps.
    #[arg(long, default_value_t = 10.0)]
    pub speed: f64,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
    /// Seconds each child gets to exit after SIGTERM before SIGKILL.
    #[arg(long, default_value_t = 10.0)]
    pub grace_s: f64,
    /// Seconds to wait for every child to report ready.
    #[arg(long, default_value_t = 120.0)]
    pub ready_timeout_s: f64,
}

/// Errors of `kvpool up`.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum UpError {
    #[error("--{flag}: {problem}")]
    Flag { flag: &'static str, problem: String },
    #[error("cannot locate this kvpool binary")]
    SelfExe(#[source] std::io::Error),
    #[error("cannot prepare the working directory {path}")]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot find free ports")]
    Ports(#[source] std::io::Error),
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
    #[error("interrupted during start-up")]
    Interrupted,
    #[error("cannot read the trace")]
    Trace(#[source] kvpool_core::sim::trace::TraceError),
    #[error("children did not stop cleanly: {0}")]
    Unclean(String),
}

impl UpError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

fn flag(flag: &'static str, problem: impl Into<String>) -> UpError {
    UpError::Flag {
        flag,
        problem: problem.into(),
    }
}

/// Stand-in token width: fixed, so the conductor and the engines agree.
const CHUNK_BYTES: usize = 4;

fn validate(args: &UpArgs, dir: PathBuf) -> Result<UpSettings, UpError> {
    if args.agents == 0 {
        return Err(flag("agents", "must be at least 1"));
    }
    if args.prefill == 0 {
        return Err(flag("prefill", "must be at least 1"));
    }
    if args.decode == 0 {
        return Err(flag("decode", "must be at least 1"));
    }
    if args.block_size == 0 {
        return Err(flag("block-size", "must be at least 1"));
    }
    if args.kv_bytes_per_token == 0 {
        return Err(flag("kv-bytes-per-token", "must be at least 1"));
    }
    if args.model.is_empty() {
        return Err(flag("model", "must not be empty"));
    }
    if !(args.speed.is_finite() && args.speed > 0.0) {
        return Err(flag(
            "speed",
            format!("must be a number > 0, got {}", args.speed),
        ));
    }
    if !(args.grace_s.is_finite() && args.grace_s >= 0.0) {
        return Err(flag("grace-s", "must be a number >= 0"));
    }
    if !(args.ready_timeout_s.is_finite() && args.ready_timeout_s > 0.0) {
        return Err(flag("ready-timeout-s", "must be a number > 0"));
    }
    let time_scale = args.time_scale.unwrap_or(1.0 / args.speed);
    if !(time_scale.is_finite() && time_scale >= 0.0) {
        return Err(flag("time-scale", "must be a number >= 0"));
    }
    if args.agent_dram.parse::<bytesize::ByteSize>().is_err() {
        return Err(flag(
            "agent-dram",
            format!("`{}` is not a size like 64MiB", args.agent_dram),
        ));
    }
    // Every child is this executable with its role as the first argument.
    let self_exe = std::env::current_exe().map_err(UpError::SelfExe)?;
    Ok(UpSettings {
        agents: args.agents,
        prefill: args.prefill,
        decode: args.decode,
        kvpool_bin: self_exe,
        dir,
        model: args.model.clone(),
        block_size: args.block_size,
        chunk_bytes: CHUNK_BYTES,
        kv_bytes_per_token: args.kv_bytes_per_token,
        agent_dram: args.agent_dram.clone(),
        time_scale,
        protocol: args.engine_protocol,
        sysfs_root: args.agent_sysfs_root.clone(),
        procfs_root: args.agent_procfs_root.clone(),
    })
}

/// Ports for the children: consecutive from `base`, or free ones the kernel picks (held until
/// all are chosen so that none repeats).
fn choose_ports(n: usize, base: u16, conductor: u16) -> Result<Vec<u16>, UpError> {
    let mut ports: Vec<u16> = if base != 0 {
        (0..n)
            .map(|i| u16::try_from(usize::from(base) + i).ok())
            .collect::<Option<_>>()
            .ok_or_else(|| flag("base-port", "leaves too few ports below 65536"))?
    } else {
        let held: Vec<std::net::TcpListener> = (0..n)
            .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
            .collect::<Result<_, _>>()
            .map_err(UpError::Ports)?;
        held.iter()
            .map(|l| l.local_addr().map(|a| a.port()))
            .collect::<Result<_, _>>()
            .map_err(UpError::Ports)?
    };
    // The conductor's API is the second to last port in the plan.
    if conductor != 0 && n >= 2 {
        if ports.contains(&conductor) {
            return Err(flag(
                "port",
                format!("{conductor} overlaps --base-port's range"),
            ));
        }
        ports[n - 2] = conductor;
    }
    Ok(ports)
}

fn random_key() -> String {
    use rand::RngCore;
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

type Http = Client<hyper_util::client::legacy::connect::HttpConnector, Body>;

/// GET `url`; status and body (bounded to 4 MiB), or `None` on a transport error.
async fn get(client: &Http, url: &str) -> Option<(u16, String)> {
    let req = http::Request::get(url).body(Body::empty()).ok()?;
    let resp = tokio::time::timeout(Duration::from_secs(5), client.request(req))
        .await
        .ok()?
        .ok()?;
    let status = resp.status().as_u16();
    let mut body = Vec::new();
    let mut stream = Body::new(resp.into_body()).into_data_stream();
    while let Some(Ok(chunk)) = stream.next().await {
        body.extend_from_slice(&chunk);
        if body.len() > 4 << 20 {
            break;
        }
    }
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}

async fn wait_ready(
    client: &Http,
    children: &mut Children,
    specs: &[ChildSpec],
    timeout: Duration,
    stop: &CancellationToken,
) -> Result<(), UpError> {
    let deadline = Instant::now() + timeout;
    for spec in specs {
        let url = format!("http://{}/readyz", spec.admin);
        loop {
            if stop.is_cancelled() {
                return Err(UpError::Interrupted);
            }
            if let Some((name, status)) = children.exited() {
                return Err(UpError::ChildExited {
                    log: children.log_path(&name),
                    name,
                    status: status.to_string(),
                });
            }
            if matches!(get(client, &url).await, Some((200, _))) {
                break;
            }
            if Instant::now() > deadline {
                return Err(UpError::NotReady {
                    name: spec.name.clone(),
                    seconds: timeout.as_secs_f64(),
                    log: children.log_path(&spec.name),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// Sum of every sample of metric `name` in a Prometheus text exposition.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let metric = series.split('{').next()?;
            (metric == name).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

/// Sum of the samples of metric `name` whose labels include `label="value"`.
pub fn metric_sum_labelled(text: &str, name: &str, label: &str, value: &str) -> f64 {
    let wanted = format!("{label}=\"{value}\"");
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, v) = l.rsplit_once(' ')?;
            let (metric, labels) = series.split_once('{')?;
            (metric == name && labels.split(',').any(|p| p.trim_end_matches('}') == wanted))
                .then(|| v.parse::<f64>().ok())?
        })
        .sum()
}

/// The timed operations of the summary's `timing` object: the engines' KV work by operation
/// (`kvpool_engine_kv_seconds{op}`), their prefill queue, and the conductor's pool lookups.
pub const TIMED: [&str; 6] = [
    "exists",
    "read",
    "write",
    "handoff_wait",
    "prefill_queue",
    "pool_lookup",
];

/// KV traffic summed over the engines, and where the time went.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineKv {
    pub read_bytes: f64,
    pub written_bytes: f64,
    pub block_hits: f64,
    pub block_misses: f64,
    pub verify_failures: f64,
    pub errors: f64,
    /// Per [`TIMED`] entry: total wall seconds and number of observations.
    pub timed_s: [f64; 6],
    pub timed_n: [f64; 6],
    /// The pool bandwidth the conductor's estimate ended on, bytes per cost-model second.
    pub fetch_bandwidth_bps: Option<f64>,
}

async fn engine_kv(client: &Http, specs: &[ChildSpec]) -> EngineKv {
    let mut kv = EngineKv::default();
    for spec in specs
        .iter()
        .filter(|s| matches!(s.role, Role::Prefill | Role::Decode))
    {
        let Some((200, text)) = get(client, &format!("http://{}/metrics", spec.admin)).await else {
            continue;
        };
        kv.read_bytes += metric_sum(&text, "kvpool_engine_kv_read_bytes_total");
        kv.written_bytes += metric_sum(&text, "kvpool_engine_kv_written_bytes_total");
        kv.block_hits += metric_sum(&text, "kvpool_engine_kv_block_hits_total");
        kv.block_misses += metric_sum(&text, "kvpool_engine_kv_block_misses_total");
        kv.verify_failures += metric_sum(&text, "kvpool_engine_kv_verify_failures_total");
        kv.errors += metric_sum(&text, "kvpool_engine_kv_errors_total");
        for (i, op) in TIMED.iter().enumerate().take(4) {
            kv.timed_s[i] += metric_sum_labelled(&text, "kvpool_engine_kv_seconds_sum", "op", op);
            kv.timed_n[i] += metric_sum_labelled(&text, "kvpool_engine_kv_seconds_count", "op", op);
        }
        kv.timed_s[4] += metric_sum(&text, "kvpool_engine_prefill_queue_seconds_sum");
        kv.timed_n[4] += metric_sum(&text, "kvpool_engine_prefill_queue_seconds_count");
    }
    if let Some(spec) = specs.iter().find(|s| s.role == Role::Conductor)
        && let Some((200, text)) = get(client, &format!("http://{}/metrics", spec.admin)).await
    {
        kv.timed_s[5] += metric_sum(&text, "kvpool_conductor_pool_lookup_seconds_sum");
        kv.timed_n[5] += metric_sum(&text, "kvpool_conductor_pool_lookup_seconds_count");
        kv.fetch_bandwidth_bps = text
            .lines()
            .any(|l| l.starts_with("kvpool_conductor_pool_fetch_bandwidth_bytes_per_second "))
            .then(|| {
                metric_sum(
                    &text,
                    "kvpool_conductor_pool_fetch_bandwidth_bytes_per_second",
                )
            });
    }
    kv
}

async fn pool_stats(master: &str, key_file: &Path) -> Option<Value> {
    let key = kvpool_proto::auth::AuthKey::from_file(key_file).ok()?;
    let client = kvpool_client::master::MasterClient::new(
        vec![master.to_owned()],
        key,
        kvpool_client::master::ClientConfig::default(),
    )
    .ok()?;
    let s = client.stats().await.ok()?;
    Some(json!({
        "objects": s.objects,
        "used_bytes": s.used_bytes.iter().sum::<u64>(),
        "capacity_bytes": s.capacity_bytes.iter().sum::<u64>(),
        "nodes_alive": s.nodes_alive,
        "segments": s.segments,
    }))
}

/// The summary printed after a replay.
pub fn summary_json(
    stats: &ReplayStats,
    speed: f64,
    kv: &EngineKv,
    pool: Option<Value>,
    clean: bool,
) -> Value {
    let lookups = kv.block_hits + kv.block_misses;
    json!({
        "requests": stats.requests,
        "served": stats.served,
        "rejected": stats.rejected,
        "failed": stats.failed,
        "generated_tokens": stats.generated_tokens,
        "wall_s": stats.wall_s,
        "speed": speed,
        "ttft_ms": {"p50": stats.ttft_ms_p50, "p99": stats.ttft_ms_p99},
        "tpot_ms": {"p50": stats.tpot_ms_p50, "p99": stats.tpot_ms_p99},
        "engines": {
            "kv_read_bytes": kv.read_bytes,
            "kv_written_bytes": kv.written_bytes,
            "kv_block_hits": kv.block_hits,
            "kv_block_misses": kv.block_misses,
            "kv_verify_failures": kv.verify_failures,
            "kv_errors": kv.errors,
            "pool_hit_ratio": (lookups > 0.0).then(|| kv.block_hits / lookups),
        },
        "timing": timing_json(kv),
        "pool": pool,
        "clean_shutdown": clean,
    })
}

/// Per timed operation, its count and mean wall milliseconds (null mean when none ran).
fn timing_json(kv: &EngineKv) -> Value {
    let mut ops = serde_json::Map::new();
    for (i, op) in TIMED.iter().enumerate() {
        let (sum, n) = (kv.timed_s[i], kv.timed_n[i]);
        ops.insert(
            (*op).to_owned(),
            json!({"count": n, "mean_ms": (n > 0.0).then(|| sum / n * 1e3)}),
        );
    }
    ops.insert(
        "conductor_fetch_bandwidth_bytes_per_s".into(),
        json!(kv.fetch_bandwidth_bps),
    );
    Value::Object(ops)
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.1} ms"))
}

fn print_summary(v: &Value, stats: &ReplayStats, kv: &EngineKv) {
    println!(
        "replayed {} requests in {:.1} s (x{} speed): served {}, rejected {}, failed {}",
        stats.requests, stats.wall_s, v["speed"], stats.served, stats.rejected, stats.failed
    );
    println!(
        "TTFT p50 {} p99 {}; TPOT p50 {} p99 {} (wall clock)",
        ms(stats.ttft_ms_p50),
        ms(stats.ttft_ms_p99),
        ms(stats.tpot_ms_p50),
        ms(stats.tpot_ms_p99)
    );
    println!(
        "engines moved KV through the agents: {:.0} bytes written, {:.0} bytes read; pool block hits {:.0}, misses {:.0}, verification failures {:.0}",
        kv.written_bytes, kv.read_bytes, kv.block_hits, kv.block_misses, kv.verify_failures
    );
    if v["pool"].is_object() {
        println!(
            "master: {} objects, {} bytes used of {}, {} nodes alive",
            v["pool"]["objects"],
            v["pool"]["used_bytes"],
            v["pool"]["capacity_bytes"],
            v["pool"]["nodes_alive"]
        );
    }
}

fn unclean(stopped: &[Stopped]) -> Option<String> {
    let bad: Vec<String> = stopped
        .iter()
        .filter(|s| !s.clean())
        .map(|s| match (&s.status, s.early) {
            (Some(st), true) => format!("{} had exited ({st})", s.name),
            (Some(st), false) => format!("{} exited {st}", s.name),
            (None, _) => format!("{} was killed", s.name),
        })
        .collect();
    (!bad.is_empty()).then(|| bad.join(", "))
}

/// Entry point of `kvpool up`.
pub fn run(args: &UpArgs) -> Result<(), UpError> {
    // Trace first: a bad file fails before anything starts.
    let records = match &args.replay {
        Some(path) => {
            let mut r =
                kvpool_core::sim::trace::load(path, args.block_size).map_err(UpError::Trace)?;
            if let Some(n) = args.limit {
                r.truncate(n);
            }
            Some(r)
        }
        None => None,
    };
    let temp = match &args.dir {
        Some(_) => None,
        None => Some(
            tempfile::Builder::new()
                .prefix("kvpool-up-")
                .tempdir()
                .map_err(|source| UpError::Dir {
                    path: std::env::temp_dir(),
                    source,
                })?,
        ),
    };
    let dir = match (&args.dir, &temp) {
        (Some(d), _) => d.clone(),
        (None, Some(t)) => t.path().to_owned(),
        (None, None) => std::env::temp_dir(),
    };
    std::fs::create_dir_all(&dir).map_err(|source| UpError::Dir {
        path: dir.clone(),
        source,
    })?;
    let settings = validate(args, dir.clone())?;
    let ports = choose_ports(plan::ports_needed(&settings), args.base_port, args.port)?;
    let specs = plan::plan(&settings, &ports).ok_or_else(|| flag("base-port", "too few ports"))?;
    let key_file = plan::key_file(&dir);
    std::fs::write(&key_file, random_key()).map_err(|source| UpError::Dir {
        path: key_file.clone(),
        source,
    })?;
    tracing::info!(dir = %dir.display(), children = specs.len(), "kvpool up: starting");

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(UpError::Runtime)?;
    let grace = Duration::from_secs_f64(args.grace_s);
    let mut children = Children::new(dir.join("logs"), grace);
    let result = runtime.block_on(async {
        let stop = CancellationToken::new();
        kvpool_runtime::shutdown::cancel_on_signal(stop.clone()).map_err(UpError::Signals)?;
        let client: Http = Client::builder(TokioExecutor::new()).build_http();
        // Start in order, each group once the one before is ready (agents need the master,
        // engines need the agents' sockets, the conductor needs the engines).
        for group in [
            &[Role::Master][..],
            &[Role::Agent],
            &[Role::Prefill, Role::Decode],
            &[Role::Conductor],
        ] {
            let members: Vec<ChildSpec> = specs
                .iter()
                .filter(|s| group.contains(&s.role))
                .cloned()
                .collect();
            for spec in &members {
                children.start(spec).map_err(UpError::Child)?;
            }
            wait_ready(
                &client,
                &mut children,
                &members,
                Duration::from_secs_f64(args.ready_timeout_s),
                &stop,
            )
            .await?;
        }
        let conductor = specs
            .iter()
            .find(|s| s.role == Role::Conductor)
            .and_then(|s| s.endpoint.clone())
            .unwrap_or_default();
        if args.json && records.is_none() {
            let children: Vec<Value> = specs
                .iter()
                .map(|s| {
                    json!({"name": s.name, "role": s.role.as_str(), "endpoint": s.endpoint,
                           "admin": format!("http://{}", s.admin)})
                })
                .collect();
            println!(
                "{}",
                json!({"ready": true, "conductor": conductor, "children": children,
                       "dir": dir.display().to_string()})
            );
        } else if !args.json {
            println!("kvpool up: ready");
            println!("  conductor  {conductor}  (OpenAI-compatible: /v1/completions, /v1/chat/completions)");
            for s in &specs {
                println!(
                    "  {:<10} {}  admin http://{}",
                    s.name,
                    s.endpoint.as_deref().unwrap_or("-"),
                    s.admin
                );
            }
            println!("  dir        {}", dir.display());
        }
        let Some(records) = &records else {
            if !args.json {
                println!("press Ctrl-C (or send SIGTERM) to stop");
            }
            // Serve until a signal, or until a child dies.
            loop {
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(Duration::from_millis(500)) => {
                        if let Some((name, status)) = children.exited() {
                            tracing::error!(child = %name, %status, "child exited; stopping");
                            break;
                        }
                    }
                }
            }
            return Ok(None);
        };
        let stats = replay::replay(
            &conductor,
            &settings.model,
            records,
            settings.block_size,
            settings.chunk_bytes,
            args.speed,
            &stop,
        )
        .await;
        let kv = engine_kv(&client, &specs).await;
        let master = specs
            .iter()
            .find(|s| s.role == Role::Master)
            .and_then(|s| s.endpoint.clone())
            .unwrap_or_default();
        let pool = pool_stats(&master, &key_file).await;
        Ok(Some((stats, kv, pool)))
    });
    let stopped = children.stop_all();
    let unclean = unclean(&stopped);
    if let Some(bad) = &unclean {
        tracing::warn!(children = %bad, logs = %dir.join("logs").display(), "unclean stop");
    }
    match result? {
        Some((stats, kv, pool)) => {
            let v = summary_json(&stats, args.speed, &kv, pool, unclean.is_none());
            if args.json {
                println!("{v}");
            } else {
                print_summary(&v, &stats, &kv);
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
    match unclean {
        Some(bad) => Err(UpError::Unclean(bad)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labelled_sums_pick_the_series_of_one_label_value() {
        let text = "# HELP x_sum h\nx_sum{op=\"read\"} 1.5\nx_sum{op=\"write\"} 2\nx_sum{op=\"read\",n=\"a\"} 1\nx_count{op=\"read\"} 3\nx_sum 9\n";
        assert_eq!(metric_sum_labelled(text, "x_sum", "op", "read"), 2.5);
        assert_eq!(metric_sum_labelled(text, "x_sum", "op", "write"), 2.0);
        assert_eq!(metric_sum_labelled(text, "x_sum", "op", "exists"), 0.0);
        let kv = EngineKv {
            timed_s: [0.0, 3.0, 0.0, 0.0, 0.0, 0.0],
            timed_n: [0.0, 4.0, 0.0, 0.0, 0.0, 0.0],
            ..EngineKv::default()
        };
        let t = timing_json(&kv);
        assert_eq!(t["read"]["mean_ms"], json!(750.0));
        assert_eq!(t["exists"]["mean_ms"], Value::Null);
    }

    #[test]
    fn metric_sum_adds_every_series_of_a_name() {
        let text = "# HELP x y\n# TYPE x counter\nx_total{op=\"a\"} 2\nx_total{op=\"b\"} 3.5\nx_total_more 9\nx_total 1\n";
        assert_eq!(metric_sum(text, "x_total"), 6.5);
        assert_eq!(metric_sum(text, "absent"), 0.0);
    }

    #[test]
    fn ports_are_distinct_and_conductor_port_is_placed() {
        let p = choose_ports(6, 0, 0).unwrap();
        let mut q = p.clone();
        q.sort_unstable();
        q.dedup();
        assert_eq!(q.len(), 6);
        assert_eq!(choose_ports(3, 40000, 0).unwrap(), [40000, 40001, 40002]);
        assert_eq!(choose_ports(3, 40000, 9000).unwrap(), [40000, 9000, 40002]);
        assert!(choose_ports(3, 40000, 40001).is_err());
        assert!(choose_ports(3, 65534, 0).is_err());
    }

    #[test]
    fn summary_has_the_hit_ratio_when_there_were_lookups() {
        let stats = ReplayStats {
            requests: 2,
            served: 2,
            ..ReplayStats::default()
        };
        let kv = EngineKv {
            block_hits: 3.0,
            block_misses: 1.0,
            ..EngineKv::default()
        };
        let v = summary_json(&stats, 10.0, &kv, None, true);
        assert_eq!(v["engines"]["pool_hit_ratio"], 0.75);
        assert!(v["pool"].is_null());
        let v = summary_json(&stats, 10.0, &EngineKv::default(), None, false);
        assert!(v["engines"]["pool_hit_ratio"].is_null());
        assert_eq!(v["clean_shutdown"], false);
    }
}
