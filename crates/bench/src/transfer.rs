//! `kvpool bench transfer`: drives the transfer engine as target, initiator or both, and measures
//! in the same run the baselines the targets are defined against (single-stream loopback iperf3
//! and single-thread memcpy). Flag names mirror Mooncake's `transfer_engine_bench`.
//! I/O boundary: the engine's sockets, the `iperf3` child processes, stdout.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use hdrhistogram::Histogram;

use kvpool_transfer::{
    AuthError, AuthKey, Endpoint, EngineConfig, HostOptions, LocalSegment, MemoryError, Protocol,
    RemoteSegment, RequestStatus, Segment, SegmentDescriptor, StaticDirectory, TransferEngine,
    TransferError, TransferMetrics, TransferOp, TransferRequest,
};

/// Default initiator run time, seconds (Mooncake's default too).
const DEFAULT_DURATION_S: f64 = 10.0;

/// Which side(s) this process runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Target and initiator in one process (plus the baselines).
    Both,
    /// Register a segment, serve it, print where, wait for SIGINT/SIGTERM.
    Target,
    /// Drive transfers against a running target.
    Initiator,
}

/// Flags of `kvpool bench transfer`.
#[derive(Clone, Debug, Args)]
pub struct TransferBenchArgs {
    #[arg(long, value_enum, default_value = "both")]
    pub mode: Mode,
    /// READ (target -> initiator) or WRITE (initiator -> target).
    #[arg(long, value_enum, default_value = "read")]
    pub operation: OperationArg,
    #[arg(long, value_enum, default_value = "tcp")]
    pub protocol: Protocol,
    /// Bytes per request (suffixes K, M, G, KiB, MiB, GiB accepted).
    #[arg(long = "block_size", alias = "block-size", default_value = "65536", value_parser = parse_size)]
    pub block_size: u64,
    /// Requests per submitted batch.
    #[arg(long = "batch_size", alias = "batch-size", default_value_t = 128)]
    pub batch_size: usize,
    /// Submitting threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Seconds to run the initiator (default 10). In target mode the target serves until
    /// SIGINT/SIGTERM, or for this many seconds when given (0 = until a signal).
    #[arg(long)]
    pub duration: Option<f64>,
    /// Size of the registered segment on each side.
    #[arg(long = "buffer_size", alias = "buffer-size", default_value = "256MiB", value_parser = parse_size)]
    pub buffer_size: u64,
    /// TCP connections per peer.
    #[arg(long, default_value_t = 2)]
    pub lanes: usize,
    /// Requests are cut into slices of this size, spread over the lanes.
    #[arg(long = "slice_size", alias = "slice-size", default_value = "4MiB", value_parser = parse_size)]
    pub slice_size: u64,
    /// Slices in flight per lane.
    #[arg(long, default_value_t = 8)]
    pub window: usize,
    /// Name of the target's segment.
    #[arg(
        long = "segment_id",
        alias = "segment-id",
        default_value = "bench/target"
    )]
    pub segment_id: String,
    /// Initiator mode: the target's TCP address.
    #[arg(long = "target_addr", alias = "target-addr")]
    pub target_addr: Option<SocketAddr>,
    /// Target mode: TCP listen address.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Unix socket of the shared-memory transport (target: where to listen; initiator: where
    /// to connect). Default: a per-process path under the temp dir.
    #[arg(long = "shm_path", alias = "shm-path")]
    pub shm_path: Option<PathBuf>,
    /// File with the pool's shared key (else KVPOOL_AUTH_KEY; `both` mode makes a random key).
    #[arg(long = "auth_key_file", alias = "auth-key-file")]
    pub auth_key_file: Option<PathBuf>,
    /// Per-wait timeout of the engine, seconds.
    #[arg(long, default_value_t = 5.0)]
    pub timeout: f64,
    /// Skip the iperf3 and memcpy baselines.
    #[arg(long = "no_baselines", alias = "no-baselines")]
    pub no_baselines: bool,
    /// Seconds each baseline runs.
    #[arg(
        long = "baseline_duration",
        alias = "baseline-duration",
        default_value_t = 3.0
    )]
    pub baseline_duration: f64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `--operation`
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OperationArg {
    Read,
    Write,
}

impl From<OperationArg> for TransferOp {
    fn from(o: OperationArg) -> Self {
        match o {
            OperationArg::Read => TransferOp::Read,
            OperationArg::Write => TransferOp::Write,
        }
    }
}

/// Errors of the transfer benchmark.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum TransferBenchError {
    #[error("invalid arguments: {0}")]
    Args(String),
    #[error("loading the auth key failed")]
    Auth(#[source] AuthError),
    #[error("allocating benchmark memory failed")]
    Memory(#[source] MemoryError),
    #[error("transfer engine error")]
    Engine(#[source] TransferError),
    #[error("waiting for a shutdown signal failed")]
    Signal(#[source] std::io::Error),
    #[error("every transfer failed; last failure: {0}")]
    AllFailed(String),
}

impl TransferBenchError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// Parse `65536`, `64K`, `4MiB`, `1G`, ... (K/M/G are powers of 1024, as in Mooncake's flags).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a size"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => return Err(format!("unknown size unit {other:?} in {s:?}")),
    };
    n.checked_mul(mult)
        .filter(|v| *v > 0)
        .ok_or_else(|| format!("size {s:?} must be > 0 and fit in 64 bits"))
}

fn secs(v: f64, what: &str) -> Result<Duration, TransferBenchError> {
    Duration::try_from_secs_f64(v)
        .map_err(|_| TransferBenchError::Args(format!("--{what} must be a non-negative number")))
}

impl TransferBenchArgs {
    fn validate(&self) -> Result<(), TransferBenchError> {
        let bad = |m: &str| Err(TransferBenchError::Args(m.to_owned()));
        if self.block_size > self.buffer_size {
            return bad("--block_size must not exceed --buffer_size");
        }
        if self.threads == 0 || self.batch_size == 0 {
            return bad("--threads and --batch_size must be > 0");
        }
        if self.mode == Mode::Initiator
            && self.protocol != Protocol::Shm
            && self.target_addr.is_none()
        {
            return bad("--mode initiator needs --target_addr (or --protocol shm with --shm_path)");
        }
        if self.mode == Mode::Initiator && self.protocol == Protocol::Shm && self.shm_path.is_none()
        {
            return bad("--mode initiator --protocol shm needs --shm_path");
        }
        Ok(())
    }

    fn engine_config(&self) -> Result<EngineConfig, TransferBenchError> {
        Ok(EngineConfig {
            node: "bench".into(),
            lanes: self.lanes,
            slice_size: self.slice_size,
            max_slice: self
                .slice_size
                .max(kvpool_transfer::frame::DEFAULT_MAX_SLICE),
            window: self.window,
            timeout: secs(self.timeout, "timeout")?,
            want_rdma: self.protocol == Protocol::Rdma,
            ..EngineConfig::default()
        })
    }

    fn shm_path(&self) -> PathBuf {
        self.shm_path.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("kvpool-bench-{}.sock", std::process::id()))
        })
    }
}

/// Results of one initiator run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct InitiatorReport {
    pub protocol: &'static str,
    pub operation: &'static str,
    pub block_size: u64,
    pub batch_size: usize,
    pub threads: usize,
    pub lanes: usize,
    pub seconds: f64,
    pub bytes: u64,
    pub requests_done: u64,
    pub requests_failed: u64,
    pub gb_per_s: f64,
    /// Batch completion latency (submit to last request settled), microseconds.
    pub batch_latency_us_p50: u64,
    pub batch_latency_us_p90: u64,
    pub batch_latency_us_p99: u64,
    pub last_failure: Option<String>,
    /// RDMA was wanted and some transfer went over TCP instead (each such event also counted
    /// in `kvpool_transfer_fallback_total`); scripts/rdma-smoke.sh requires false.
    pub rdma_fallback: bool,
    /// Local RDMA devices that carried the transfers (empty unless the route is RDMA).
    pub rdma_devices: Vec<String>,
}

/// Entry point of `kvpool bench transfer`.
pub fn run(args: TransferBenchArgs) -> Result<(), TransferBenchError> {
    args.validate()?;
    match args.mode {
        Mode::Target => run_target(&args),
        Mode::Initiator => {
            let key =
                AuthKey::load(args.auth_key_file.as_deref()).map_err(TransferBenchError::Auth)?;
            let engine = new_engine(&args, key)?;
            let mut endpoints = Vec::new();
            if let Some(a) = args.target_addr {
                endpoints.push(Endpoint::Tcp(a));
            }
            if let Some(p) = &args.shm_path {
                endpoints.push(Endpoint::Shm(p.clone()));
            }
            let desc = SegmentDescriptor {
                name: args.segment_id.clone(),
                node: "bench".into(),
                size: args.buffer_size,
                numa_node: None,
                memory: Default::default(),
                endpoints,
                nics: Vec::new(),
            };
            let report = run_initiator(&args, &engine, &desc)?;
            print_report(&args, &report, None);
            Ok(())
        }
        Mode::Both => {
            let key = match &args.auth_key_file {
                Some(p) => AuthKey::from_file(p).map_err(TransferBenchError::Auth)?,
                None => AuthKey::from_env()
                    .or_else(|_| AuthKey::random())
                    .map_err(TransferBenchError::Auth)?,
            };
            // Baselines run right before and right after the transfers and are averaged, so a
            // change of background load during the run biases neither side.
            let before = if args.no_baselines {
                None
            } else {
                Some(measure_baselines(&args)?)
            };
            let target = Target::start(&args, key.clone())?;
            let engine = new_engine(&args, key)?;
            let report = run_initiator(&args, &engine, &target.descriptor)?;
            drop(engine);
            drop(target);
            let baselines = match before {
                Some(b) => Some(b.merge(measure_baselines(&args)?)),
                None => None,
            };
            print_report(&args, &report, baselines.as_ref());
            Ok(())
        }
    }
}

fn new_engine(
    args: &TransferBenchArgs,
    key: AuthKey,
) -> Result<TransferEngine, TransferBenchError> {
    let metrics = TransferMetrics::unregistered()
        .map_err(|e| TransferBenchError::Args(format!("metrics: {e}")))?;
    TransferEngine::new(
        args.engine_config()?,
        key,
        Arc::new(StaticDirectory::new()),
        metrics,
    )
    .map_err(TransferBenchError::Engine)
}

struct Target {
    _engine: TransferEngine,
    _segment: LocalSegment,
    _tcp: kvpool_transfer::TcpServer,
    _shm: kvpool_transfer::ShmServer,
    descriptor: SegmentDescriptor,
}

impl Target {
    fn start(args: &TransferBenchArgs, key: AuthKey) -> Result<Self, TransferBenchError> {
        let engine = new_engine(args, key)?;
        let size = usize::try_from(args.buffer_size)
            .map_err(|_| TransferBenchError::Args("--buffer_size too large".into()))?;
        let seg = Segment::memfd(&args.segment_id, size, HostOptions::default())
            .map_err(TransferBenchError::Memory)?;
        seg.fill(0, size, 0x5a)
            .map_err(TransferBenchError::Memory)?;
        let segment = engine
            .register(&args.segment_id, Arc::new(seg))
            .map_err(TransferBenchError::Engine)?;
        let tcp = engine
            .listen_tcp(args.listen)
            .map_err(TransferBenchError::Engine)?;
        let shm = engine
            .listen_shm(&args.shm_path())
            .map_err(TransferBenchError::Engine)?;
        let descriptor = engine.describe(
            &segment,
            vec![
                Endpoint::Tcp(tcp.local_addr()),
                Endpoint::Shm(shm.path().to_owned()),
            ],
        );
        Ok(Target {
            _engine: engine,
            _segment: segment,
            _tcp: tcp,
            _shm: shm,
            descriptor,
        })
    }
}

fn run_target(args: &TransferBenchArgs) -> Result<(), TransferBenchError> {
    let key = AuthKey::load(args.auth_key_file.as_deref()).map_err(TransferBenchError::Auth)?;
    let target = Target::start(args, key)?;
    let tcp = target.descriptor.tcp_endpoint();
    let shm = target.descriptor.shm_endpoint().cloned();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "kvpool-bench-target tcp={} shm={} segment={} size={}",
        tcp.map(|a| a.to_string()).unwrap_or_default(),
        shm.map(|p| p.display().to_string()).unwrap_or_default(),
        args.segment_id,
        args.buffer_size
    );
    let _ = out.flush();
    drop(out);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(TransferBenchError::Signal)?;
    let limit = match args.duration {
        Some(d) if d > 0.0 => Some(secs(d, "duration")?),
        _ => None,
    };
    rt.block_on(async {
        let token = tokio_util::sync::CancellationToken::new();
        kvpool_runtime::shutdown::cancel_on_signal(token.clone())
            .map_err(TransferBenchError::Signal)?;
        match limit {
            Some(d) => {
                let _ = tokio::time::timeout(d, token.cancelled()).await;
            }
            None => token.cancelled().await,
        }
        Ok::<_, TransferBenchError>(())
    })?;
    drop(target);
    Ok(())
}

/// Run the initiator side against `desc` and return the measurements.
pub fn run_initiator_with(
    args: &TransferBenchArgs,
    engine: &TransferEngine,
    desc: &SegmentDescriptor,
) -> Result<InitiatorReport, TransferBenchError> {
    run_initiator(args, engine, desc)
}

fn run_initiator(
    args: &TransferBenchArgs,
    engine: &TransferEngine,
    desc: &SegmentDescriptor,
) -> Result<InitiatorReport, TransferBenchError> {
    let remote = engine
        .open_descriptor(desc, Some(args.protocol))
        .map_err(TransferBenchError::Engine)?;
    let size = usize::try_from(args.buffer_size)
        .map_err(|_| TransferBenchError::Args("--buffer_size too large".into()))?;
    let local_seg =
        Segment::host(size, HostOptions::default()).map_err(TransferBenchError::Memory)?;
    local_seg
        .fill(0, size, 0xa5)
        .map_err(TransferBenchError::Memory)?;
    let local = engine
        .register(
            &format!("{}-initiator-{}", args.segment_id, std::process::id()),
            Arc::new(local_seg),
        )
        .map_err(TransferBenchError::Engine)?;
    let remote_size = remote.len().min(args.buffer_size);
    let slots = (remote_size / args.block_size).max(1);
    let op: TransferOp = args.operation.into();
    let duration = secs(args.duration.unwrap_or(DEFAULT_DURATION_S), "duration")?;
    let wait_limit = secs(args.timeout, "timeout")? * 4;

    let template = new_histogram()?;
    let start = Instant::now();
    let results: Vec<ThreadResult> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..args.threads)
            .map(|t| {
                let reqs = build_requests(args, &local, &remote, op, t, slots);
                let hist = template.clone();
                s.spawn(move || drive(engine, reqs, duration, wait_limit, hist))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| ThreadResult::crashed(template.clone()))
            })
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();

    let mut hist = template;
    let (mut bytes, mut done, mut failed, mut last_failure) = (0u64, 0u64, 0u64, None);
    for r in results {
        bytes += r.bytes;
        done += r.done;
        failed += r.failed;
        if r.last_failure.is_some() {
            last_failure = r.last_failure;
        }
        let _ = hist.add(&r.hist);
    }
    if done == 0 {
        return Err(TransferBenchError::AllFailed(
            last_failure.unwrap_or_else(|| "no request completed".into()),
        ));
    }
    Ok(InitiatorReport {
        protocol: remote.protocol().as_str(),
        operation: op.as_str(),
        block_size: args.block_size,
        batch_size: args.batch_size,
        threads: args.threads,
        lanes: args.lanes,
        seconds,
        bytes,
        requests_done: done,
        requests_failed: failed,
        gb_per_s: bytes as f64 / seconds / 1e9,
        batch_latency_us_p50: hist.value_at_quantile(0.50),
        batch_latency_us_p90: hist.value_at_quantile(0.90),
        batch_latency_us_p99: hist.value_at_quantile(0.99),
        last_failure,
        rdma_fallback: engine.fallback_active(),
        rdma_devices: remote.rdma_devices(),
    })
}

fn new_histogram() -> Result<Histogram<u64>, TransferBenchError> {
    // 1 us .. 100 s at 3 significant digits.
    Histogram::new_with_bounds(1, 100_000_000, 3)
        .map_err(|e| TransferBenchError::Args(format!("latency histogram: {e}")))
}

fn build_requests(
    args: &TransferBenchArgs,
    local: &LocalSegment,
    remote: &RemoteSegment,
    op: TransferOp,
    thread: usize,
    slots: u64,
) -> Vec<TransferRequest> {
    (0..args.batch_size)
        .map(|i| {
            let slot = ((thread * args.batch_size + i) as u64) % slots;
            let off = slot * args.block_size;
            TransferRequest {
                op,
                local: local.clone(),
                local_offset: off,
                remote: remote.clone(),
                remote_offset: off,
                len: args.block_size,
            }
        })
        .collect()
}

struct ThreadResult {
    bytes: u64,
    done: u64,
    failed: u64,
    last_failure: Option<String>,
    hist: Histogram<u64>,
}

impl ThreadResult {
    fn crashed(hist: Histogram<u64>) -> Self {
        ThreadResult {
            bytes: 0,
            done: 0,
            failed: 1,
            last_failure: Some("benchmark thread panicked".into()),
            hist,
        }
    }
}

fn drive(
    engine: &TransferEngine,
    reqs: Vec<TransferRequest>,
    duration: Duration,
    wait_limit: Duration,
    hist: Histogram<u64>,
) -> ThreadResult {
    let mut r = ThreadResult {
        bytes: 0,
        done: 0,
        failed: 0,
        last_failure: None,
        hist,
    };
    let deadline = Instant::now() + duration;
    while Instant::now() < deadline {
        let t0 = Instant::now();
        let batch = match engine.submit(reqs.clone()) {
            Ok(b) => b,
            Err(e) => {
                r.failed += reqs.len() as u64;
                r.last_failure = Some(e.to_string());
                break;
            }
        };
        match batch.wait(wait_limit) {
            Ok(statuses) => {
                let _ = r.hist.record(t0.elapsed().as_micros().max(1) as u64);
                for (s, q) in statuses.iter().zip(&reqs) {
                    match s {
                        RequestStatus::Done => {
                            r.done += 1;
                            r.bytes += q.len;
                        }
                        RequestStatus::Failed(f) => {
                            r.failed += 1;
                            r.last_failure = Some(f.to_string());
                        }
                        RequestStatus::Pending => r.failed += 1,
                    }
                }
            }
            Err(e) => {
                r.failed += reqs.len() as u64;
                r.last_failure = Some(e.to_string());
            }
        }
    }
    r
}

/// Baseline figures measured in the same run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Baselines {
    /// Single-stream loopback iperf3 throughput, GB/s: mean of `iperf3_runs` (None if iperf3
    /// could not run).
    pub iperf3_gb_per_s: Option<f64>,
    pub iperf3_runs: Vec<f64>,
    pub iperf3_error: Option<String>,
    /// Single-thread memcpy bandwidth, GB/s: mean of `memcpy_runs`.
    pub memcpy_gb_per_s: f64,
    pub memcpy_runs: Vec<f64>,
}

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

impl Baselines {
    /// Combine two measurements (before and after the transfers).
    pub fn merge(mut self, other: Baselines) -> Baselines {
        self.iperf3_runs.extend(other.iperf3_runs);
        self.memcpy_runs.extend(other.memcpy_runs);
        self.iperf3_gb_per_s = mean(&self.iperf3_runs);
        self.memcpy_gb_per_s = mean(&self.memcpy_runs).unwrap_or(0.0);
        self.iperf3_error = self.iperf3_error.or(other.iperf3_error);
        self
    }
}

fn measure_baselines(args: &TransferBenchArgs) -> Result<Baselines, TransferBenchError> {
    let d = secs(args.baseline_duration, "baseline_duration")?;
    let (iperf3_gb_per_s, iperf3_error) = match iperf3_loopback(d) {
        Ok(v) => (Some(v), None),
        Err(e) => (None, Some(e)),
    };
    let memcpy = memcpy_bandwidth(args.block_size, d);
    Ok(Baselines {
        iperf3_gb_per_s,
        iperf3_runs: iperf3_gb_per_s.into_iter().collect(),
        iperf3_error,
        memcpy_gb_per_s: memcpy,
        memcpy_runs: vec![memcpy],
    })
}

/// Single-thread memcpy bandwidth (bytes copied per second, GB/s) with `block`-sized copies
/// between two 64 MiB buffers (larger than the caches).
pub fn memcpy_bandwidth(block: u64, duration: Duration) -> f64 {
    const BUF: usize = 64 << 20;
    let block = (block as usize).clamp(1, BUF);
    let src = vec![0x11u8; BUF];
    let mut dst = vec![0u8; BUF];
    let mut copied = 0u64;
    let start = Instant::now();
    let mut off = 0usize;
    while start.elapsed() < duration {
        for _ in 0..16 {
            if off + block > BUF {
                off = 0;
            }
            dst[off..off + block].copy_from_slice(&src[off..off + block]);
            off += block;
            copied += block as u64;
        }
    }
    std::hint::black_box(&dst);
    copied as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// Run `iperf3 -s` and `iperf3 -c 127.0.0.1 -J` on a free port; returns GB/s received.
pub fn iperf3_loopback(duration: Duration) -> Result<f64, String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .port();
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start iperf3 (install Debian's iperf3): {e}"))?;
    let secs = duration.as_secs().max(1).to_string();
    let mut result = Err("iperf3 client did not run".to_owned());
    for _ in 0..50 {
        let out = Command::new("iperf3")
            .args([
                "-c",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "-J",
                "-t",
                &secs,
            ])
            .output();
        result = match out {
            Ok(o) => parse_iperf3_json(&String::from_utf8_lossy(&o.stdout)),
            Err(e) => Err(e.to_string()),
        };
        if result.is_ok() {
            break;
        }
        // The server may not be listening yet.
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = server.kill();
    let _ = server.wait();
    result
}

/// Extract the receiver-side throughput (GB/s) from `iperf3 -J` output.
pub fn parse_iperf3_json(text: &str) -> Result<f64, String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("iperf3 output is not JSON: {e}"))?;
    if let Some(err) = v.get("error").and_then(|e| e.as_str()) {
        return Err(format!("iperf3: {err}"));
    }
    v.pointer("/end/sum_received/bits_per_second")
        .and_then(|b| b.as_f64())
        .map(|bps| bps / 8.0 / 1e9)
        .ok_or_else(|| "iperf3 JSON lacks end.sum_received.bits_per_second".into())
}

fn print_report(args: &TransferBenchArgs, r: &InitiatorReport, b: Option<&Baselines>) {
    let tcp_ratio = b
        .and_then(|b| b.iperf3_gb_per_s)
        .filter(|_| r.protocol == "tcp")
        .map(|i| r.gb_per_s / i);
    let shm_ratio = b
        .filter(|_| r.protocol == "shm")
        .map(|b| r.gb_per_s / b.memcpy_gb_per_s);
    if args.json {
        let v = serde_json::json!({
            "transfer": r,
            "baselines": b,
            "ratio_vs_iperf3": tcp_ratio,
            "ratio_vs_memcpy": shm_ratio,
            "targets": {"tcp_vs_iperf3": 0.9, "shm_vs_memcpy": 0.5},
        });
        println!("{v}");
        return;
    }
    println!(
        "protocol={} op={} block_size={} batch_size={} threads={} lanes={}",
        r.protocol, r.operation, r.block_size, r.batch_size, r.threads, r.lanes
    );
    println!(
        "throughput: {:.3} GB/s ({} requests done, {} failed, {:.1} s)",
        r.gb_per_s, r.requests_done, r.requests_failed, r.seconds
    );
    println!(
        "batch latency: p50 {} us, p90 {} us, p99 {} us",
        r.batch_latency_us_p50, r.batch_latency_us_p90, r.batch_latency_us_p99
    );
    if let Some(f) = &r.last_failure {
        println!("last failure: {f}");
    }
    if let Some(b) = b {
        match (b.iperf3_gb_per_s, &b.iperf3_error) {
            (Some(v), _) => println!(
                "baseline iperf3 single-stream loopback: {v:.3} GB/s (mean of {:.3?}, before and after)",
                b.iperf3_runs
            ),
            (None, Some(e)) => println!("baseline iperf3: unavailable ({e})"),
            (None, None) => {}
        }
        println!(
            "baseline memcpy single thread: {:.3} GB/s",
            b.memcpy_gb_per_s
        );
    }
    if let Some(x) = tcp_ratio {
        println!(
            "tcp / iperf3 = {:.1}% (target >= 90%: {})",
            x * 100.0,
            if x >= 0.9 { "met" } else { "NOT met" }
        );
    }
    if let Some(x) = shm_ratio {
        println!(
            "shm / memcpy = {:.1}% (target >= 50%: {})",
            x * 100.0,
            if x >= 0.5 { "met" } else { "NOT met" }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        a: TransferBenchArgs,
    }

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("65536"), Ok(65536));
        assert_eq!(parse_size("4MiB"), Ok(4 << 20));
        assert_eq!(parse_size("4M"), Ok(4 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("0").is_err());
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
    }

    #[test]
    fn mooncake_style_flags_parse() {
        let w = Wrap::try_parse_from([
            "x",
            "--mode",
            "initiator",
            "--operation",
            "write",
            "--protocol",
            "tcp",
            "--block_size",
            "4MiB",
            "--batch_size",
            "16",
            "--threads",
            "2",
            "--duration",
            "3",
            "--target_addr",
            "10.0.0.2:7400",
            "--json",
        ])
        .unwrap();
        assert_eq!(w.a.block_size, 4 << 20);
        assert_eq!(w.a.mode, Mode::Initiator);
        assert!(w.a.validate().is_ok());
        let w = Wrap::try_parse_from(["x", "--mode", "initiator"]).unwrap();
        assert!(matches!(w.a.validate(), Err(TransferBenchError::Args(_))));
    }

    #[test]
    fn iperf3_json_is_parsed_and_errors_are_reported() {
        let ok = r#"{"start":{},"end":{"sum_received":{"bits_per_second":8e10}}}"#;
        assert!((parse_iperf3_json(ok).unwrap() - 10.0).abs() < 1e-9);
        let err = r#"{"start":{},"error":"unable to connect to server"}"#;
        assert!(
            parse_iperf3_json(err)
                .unwrap_err()
                .contains("unable to connect")
        );
        assert!(parse_iperf3_json("not json").is_err());
    }

    #[test]
    fn baselines_before_and_after_are_averaged() {
        let a = Baselines {
            iperf3_gb_per_s: Some(1.0),
            iperf3_runs: vec![1.0],
            iperf3_error: None,
            memcpy_gb_per_s: 4.0,
            memcpy_runs: vec![4.0],
        };
        let b = Baselines {
            iperf3_gb_per_s: Some(3.0),
            iperf3_runs: vec![3.0],
            iperf3_error: None,
            memcpy_gb_per_s: 2.0,
            memcpy_runs: vec![2.0],
        };
        let m = a.merge(b);
        assert_eq!(m.iperf3_gb_per_s, Some(2.0));
        assert_eq!(m.memcpy_gb_per_s, 3.0);
        assert_eq!(m.iperf3_runs.len(), 2);
    }

    #[test]
    fn memcpy_baseline_measures_something() {
        assert!(memcpy_bandwidth(1 << 20, Duration::from_millis(50)) > 0.0);
    }
}
