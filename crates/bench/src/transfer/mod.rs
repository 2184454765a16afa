//! `kvpool bench transfer`: drives the transfer engine as target, initiator or both, and measures
//! in the same run the baselines the targets are defined against (single-stream loopback iperf3
//! and single-thread memcpy). Flag names mirror Mooncake's `transfer_engine_bench`.
//! The flags and the entry point live here; `target`, `initiator`, `baselines` and `report` do
//! the rest. I/O boundary: the engine's sockets, the `iperf3` child processes, stdout.

mod baselines;
mod initiator;
mod report;
mod target;
mod vs_mooncake;

pub use self::baselines::{Baselines, iperf3_loopback, memcpy_bandwidth, parse_iperf3_json};
pub use self::initiator::{InitiatorReport, run_initiator_with};
pub use self::vs_mooncake::MooncakeRun;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};

use kvpool_transfer::{
    AuthError, AuthKey, Endpoint, EngineConfig, Integrity, MemoryError, Protocol,
    SegmentDescriptor, StaticDirectory, TlsMode, TransferEngine, TransferError, TransferMetrics,
    TransferOp, TransferTls,
};

use self::baselines::measure_baselines;
use self::initiator::run_initiator;
use self::report::print_report;
use self::target::{Target, run_target};
/// Default initiator run time, seconds (Mooncake's default too).
pub(super) const DEFAULT_DURATION: Duration = Duration::from_secs(10);

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
    #[arg(long = "block-size", alias = "block_size", default_value = "65536", value_parser = parse_size)]
    pub block_size: u64,
    /// Requests per submitted batch.
    #[arg(long = "batch-size", alias = "batch_size", default_value_t = 128)]
    pub batch_size: usize,
    /// Submitting threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// How long the initiator runs (default 10s; a bare number is seconds). In target mode
    /// the target serves until SIGINT/SIGTERM, or for this long when given (0 = until a
    /// signal).
    #[arg(long, value_parser = kvpool_core::flags::parse_duration)]
    pub duration: Option<Duration>,
    /// Size of the registered segment on each side.
    #[arg(long = "buffer-size", alias = "buffer_size", default_value = "256MiB", value_parser = parse_size)]
    pub buffer_size: u64,
    /// TCP connections per peer.
    #[arg(long, default_value_t = 2)]
    pub lanes: usize,
    /// Requests are cut into slices of this size, spread over the lanes.
    #[arg(long = "slice-size", alias = "slice_size", default_value = "4MiB", value_parser = parse_size)]
    pub slice_size: u64,
    /// Slices in flight per lane.
    #[arg(long, default_value_t = 8)]
    pub window: usize,
    /// Per-frame integrity of the TCP lanes (docs/transfer.md "Per-frame integrity"):
    /// `require` seals every frame (both sides in `both` mode), `allow` the default.
    #[arg(long, value_enum, default_value = "allow")]
    pub integrity: Integrity,
    /// Also run the same cell over TLS (docs/transfer.md "TLS"; a throw-away CA and a
    /// certificate for 127.0.0.1 in a temporary directory), right after the plaintext run, and
    /// report both and TLS / plain (`--mode both --protocol tcp` only).
    #[arg(long)]
    pub tls: bool,
    /// The TLS setting both engines of a run use (set for the TLS run of `--tls`).
    #[arg(skip)]
    pub engine_tls: TransferTls,
    /// Name of the target's segment.
    #[arg(
        long = "segment-id",
        alias = "segment_id",
        default_value = "bench/target"
    )]
    pub segment_id: String,
    /// Initiator mode: the target's TCP address.
    #[arg(long = "target-addr", alias = "target_addr")]
    pub target_addr: Option<SocketAddr>,
    /// Target mode: TCP listen address.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Unix socket of the shared-memory transport (target: where to listen; initiator: where
    /// to connect). Default: a per-process path under the temp dir.
    #[arg(long = "shm-path", alias = "shm_path")]
    pub shm_path: Option<PathBuf>,
    /// File with the pool's shared key (else KVPOOL_AUTH_KEY; `both` mode makes a random key).
    #[arg(long = "auth-key-file", alias = "auth_key_file")]
    pub auth_key_file: Option<PathBuf>,
    /// Per-wait timeout of the engine.
    #[arg(long, default_value = "5s", value_parser = kvpool_core::flags::parse_duration)]
    pub timeout: Duration,
    /// Skip the iperf3 and memcpy baselines.
    #[arg(long = "no-baselines", alias = "no_baselines")]
    pub no_baselines: bool,
    /// How long each baseline runs.
    #[arg(
        long = "baseline-duration",
        alias = "baseline_duration",
        default_value = "3s",
        value_parser = kvpool_core::flags::parse_duration
    )]
    pub baseline_duration: Duration,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// `--vs-mooncake` and `--mooncake-venv`.
    #[command(flatten)]
    pub mooncake: crate::mooncake::VsMooncakeArgs,
    /// With --vs-mooncake: rounds of both sides, alternating which goes first; medians are
    /// compared.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
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
    #[error("the Mooncake side of --vs-mooncake failed")]
    Mooncake(#[source] crate::mooncake::MooncakeError),
}

kvpool_runtime::error_category!(TransferBenchError);

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

impl TransferBenchArgs {
    fn validate(&self) -> Result<(), TransferBenchError> {
        let bad = |m: &str| Err(TransferBenchError::Args(m.to_owned()));
        if self.block_size > self.buffer_size {
            return bad("--block-size must not exceed --buffer-size");
        }
        if self.threads == 0 || self.batch_size == 0 {
            return bad("--threads and --batch-size must be > 0");
        }
        if self.mode == Mode::Initiator
            && self.protocol != Protocol::Shm
            && self.target_addr.is_none()
        {
            return bad("--mode initiator needs --target-addr (or --protocol shm with --shm-path)");
        }
        if self.mode == Mode::Initiator && self.protocol == Protocol::Shm && self.shm_path.is_none()
        {
            return bad("--mode initiator --protocol shm needs --shm-path");
        }
        if self.mooncake.vs_mooncake && (self.mode != Mode::Both || self.protocol != Protocol::Tcp)
        {
            return bad("--vs-mooncake needs --mode both --protocol tcp");
        }
        if self.tls && (self.mode != Mode::Both || self.protocol != Protocol::Tcp) {
            return bad("--tls needs --mode both --protocol tcp");
        }
        if self.tls && self.mooncake.vs_mooncake {
            return bad("--tls and --vs-mooncake do not go together");
        }
        if self.mooncake.vs_mooncake && self.rounds == 0 {
            return bad("--rounds must be > 0");
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
            timeout: self.timeout,
            want_rdma: self.protocol == Protocol::Rdma,
            integrity: self.integrity,
            tls: self.engine_tls.clone(),
            ..EngineConfig::default()
        })
    }

    fn shm_path(&self) -> PathBuf {
        self.shm_path.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("kvpool-bench-{}.sock", std::process::id()))
        })
    }
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
                gpu_device: None,
                endpoints,
                nics: Vec::new(),
            };
            let report = run_initiator(&args, &engine, &desc)?;
            print_report(&args, &report, None, None, None);
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
            let (report, versus) = if args.mooncake.vs_mooncake {
                let (report, versus) = against_mooncake(&args, &key)?;
                (report, Some(versus))
            } else {
                (run_kvpool(&args, &key)?, None)
            };
            let tls = if args.tls {
                Some(run_tls(&args, &key)?)
            } else {
                None
            };
            let baselines = match before {
                Some(b) => Some(b.merge(measure_baselines(&args)?)),
                None => None,
            };
            print_report(
                &args,
                &report,
                baselines.as_ref(),
                versus.as_ref(),
                tls.as_ref(),
            );
            Ok(())
        }
    }
}

/// One kvpool run in this process: a fresh target, an initiator against it.
fn run_kvpool(
    args: &TransferBenchArgs,
    key: &AuthKey,
) -> Result<InitiatorReport, TransferBenchError> {
    let target = Target::start(args, key.clone())?;
    let engine = new_engine(args, key.clone())?;
    let report = run_initiator(args, &engine, &target.descriptor)?;
    drop(engine);
    drop(target);
    Ok(report)
}

/// The `--tls` run: the same cell with both engines on TLS `require`, verified by a
/// throw-away CA.
fn run_tls(args: &TransferBenchArgs, key: &AuthKey) -> Result<InitiatorReport, TransferBenchError> {
    let dir = tempfile::Builder::new()
        .prefix("kvpool-bench-tls-")
        .tempdir()
        .map_err(|e| TransferBenchError::Args(format!("temp dir: {e}")))?;
    let files = kvpool_harness::tls::write_throwaway(
        dir.path(),
        "kvpool bench transfer CA",
        &["127.0.0.1"],
    )
    .map_err(|e| TransferBenchError::Args(format!("throw-away TLS certificates: {e}")))?;
    let mut tls_args = args.clone();
    tls_args.engine_tls = TransferTls {
        mode: TlsMode::Require,
        cert_file: Some(files.master_cert),
        key_file: Some(files.master_key),
        ca_file: Some(files.ca),
        server_name: None,
    };
    run_kvpool(&tls_args, key)
}

/// kvpool and Mooncake over the same cell, `--rounds` times each, alternating which side goes
/// first; the kvpool report returned is its median run's.
fn against_mooncake(
    args: &TransferBenchArgs,
    key: &AuthKey,
) -> Result<(InitiatorReport, Versus), TransferBenchError> {
    let mc = crate::mooncake::Mooncake::find_or_install(args.mooncake.mooncake_venv.as_deref())
        .map_err(TransferBenchError::Mooncake)?;
    let logs = tempfile::Builder::new()
        .prefix("kvpool-vs-mooncake-")
        .tempdir()
        .map_err(|e| TransferBenchError::Args(format!("temp dir: {e}")))?;
    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    for round in 0..args.rounds {
        let mooncake_first = round % 2 == 1;
        if mooncake_first {
            theirs.push(
                vs_mooncake::run_round(&mc, args, logs.path(), round)
                    .map_err(TransferBenchError::Mooncake)?,
            );
        }
        ours.push(run_kvpool(args, key)?);
        if !mooncake_first {
            theirs.push(
                vs_mooncake::run_round(&mc, args, logs.path(), round)
                    .map_err(TransferBenchError::Mooncake)?,
            );
        }
    }
    let kvpool: Vec<f64> = ours.iter().map(|r| r.gb_per_s).collect();
    let mooncake: Vec<f64> = theirs.iter().map(|r| r.gb_per_s).collect();
    let (ours_median, theirs_median) = (
        crate::mooncake::median(&kvpool),
        crate::mooncake::median(&mooncake),
    );
    let versus = Versus {
        mooncake_version: mc.version.clone(),
        mooncake_command: format!(
            "{} {}",
            mc.bin("transfer_engine_bench").display(),
            vs_mooncake::initiator_flags(args, 0, "127.0.0.1:PORT").join(" ")
        ),
        kvpool_gb_per_s: kvpool,
        mooncake_gb_per_s: mooncake,
        mooncake_runs: theirs,
        kvpool_median_gb_per_s: ours_median,
        mooncake_median_gb_per_s: theirs_median,
        ratio: (theirs_median > 0.0).then(|| ours_median / theirs_median),
    };
    // The kvpool run closest to the median stands for the cell.
    let report = ours
        .into_iter()
        .min_by(|a, b| {
            (a.gb_per_s - ours_median)
                .abs()
                .total_cmp(&(b.gb_per_s - ours_median).abs())
        })
        .ok_or_else(|| TransferBenchError::Args("no round ran".into()))?;
    Ok((report, versus))
}

/// Both sides of `--vs-mooncake`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Versus {
    pub mooncake_version: String,
    /// Mooncake's initiator as run (ports vary per round).
    pub mooncake_command: String,
    pub kvpool_gb_per_s: Vec<f64>,
    pub mooncake_gb_per_s: Vec<f64>,
    pub mooncake_runs: Vec<MooncakeRun>,
    pub kvpool_median_gb_per_s: f64,
    pub mooncake_median_gb_per_s: f64,
    /// kvpool's median over Mooncake's.
    pub ratio: Option<f64>,
}

pub(super) fn new_engine(
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

#[cfg(test)]
mod tests;
