//! `kvpool bench store`: the pool's data path end to end on 127.0.0.1. Starts a `kvpool master`,
//! M `kvpool agent run` processes in pool mode and N client processes (this binary re-executed
//! with the hidden `--worker` flag), drives put/get phases per value size and `exists` /
//! `longest_prefix` phases through a stdin/stdout barrier, and measures Debian's `redis-server`
//! with `redis-benchmark` in the same run as the baseline. Planning, CSV parsing and aggregation
//! are pure; I/O boundary: child processes, their pipes and log files, loopback sockets, stdout.

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::transfer::parse_size;
use kvpool_client::master::{ClientConfig, ClientError, MasterClient};
use kvpool_client::pool::{DataError, PoolClient};
use kvpool_core::master::types::PutOptions;
use kvpool_harness::{free_port, wait_for_port};
use kvpool_proto::auth::AuthKey as MasterKey;
use kvpool_transfer::{
    self as transfer, EngineConfig, StaticDirectory, TransferEngine, TransferMetrics,
};

/// Bytes stamped at the start of every value to make it unique (worker id and index).
const STAMP: usize = 16;
/// How long child processes get to come up.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// Keys per remove call when a phase's objects are dropped.
const REMOVE_CHUNK: usize = 1000;

/// Flags of `kvpool bench store`.
#[derive(Clone, Debug, Args)]
pub struct StoreBenchArgs {
    /// Agent processes (`kvpool agent run` in pool mode).
    #[arg(long, default_value_t = 2)]
    pub agents: usize,
    /// Client processes. One process with 8 operations in flight measured faster on the
    /// 2-core machine than two with 4 each (fewer threads competing for the cores), and is the
    /// shape of the Redis baseline: one `redis-benchmark` process.
    #[arg(long, default_value_t = 1)]
    pub clients: usize,
    /// Puts or gets in flight per client process.
    #[arg(long, default_value_t = 8)]
    pub depth: usize,
    /// Value sizes measured (comma separated; K/M/G suffixes are powers of 1024).
    #[arg(long, value_delimiter = ',', default_value = "64KiB,1MiB,4MiB", value_parser = parse_size)]
    pub sizes: Vec<u64>,
    /// Bytes put (and then got) per value size, over all clients.
    #[arg(long, default_value = "384MiB", value_parser = parse_size)]
    pub bytes_per_size: u64,
    /// Operations per client per size and round; overrides --bytes-per-size.
    #[arg(long)]
    pub ops: Option<u64>,
    /// Rounds of put, get and remove per size (each round moves --bytes-per-size); a 1 MiB
    /// round lasts about 0.2 s, so 8 rounds time about as long as the Redis baseline runs.
    #[arg(long, default_value_t = 8)]
    pub rounds: u32,
    /// Replicas per object.
    #[arg(long, default_value_t = 1)]
    pub replicas: u8,
    /// DRAM capacity of each agent.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub agent_capacity: u64,
    /// TCP lanes of each client's transfer engine (per agent).
    #[arg(long, default_value_t = 4)]
    pub lanes: usize,
    /// Keys per `exists` / `longest_prefix` call.
    #[arg(long, default_value_t = 100)]
    pub batch: usize,
    /// Duration of each metadata phase.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub lookup_duration: Duration,
    /// Let agents discover the host (/sys, /proc). By default they get a one-NUMA-node
    /// description of this host whose free memory is MemAvailable (page cache included), so
    /// that a busy build machine's small MemFree does not stop them.
    #[arg(long)]
    pub host_topology: bool,
    /// Skip the Redis baseline.
    #[arg(long)]
    pub no_redis: bool,
    /// Requests per `redis-benchmark` test (1 MiB values, 4 connections).
    #[arg(long, default_value_t = 3000)]
    pub redis_requests: u64,
    /// Client API measured: `registered` puts from and gets straight into a buffer registered
    /// with the engine (`put_from` / `get_to`, no staging copy); `copy` uses `put(&[u8])` and
    /// `get() -> Vec<u8>`.
    #[arg(long, value_enum, default_value = "registered")]
    pub api: Api,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Internal: run as client process number N of a benchmark.
    #[arg(long, hide = true)]
    pub worker: Option<usize>,
    /// Internal (worker): the master's gRPC address.
    #[arg(long, hide = true)]
    pub master: Option<SocketAddr>,
    /// Internal (worker): the pool's key file.
    #[arg(long, hide = true)]
    pub key_file: Option<PathBuf>,
}

/// Which client calls the data phases use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    Registered,
    Copy,
}

impl Api {
    fn as_str(self) -> &'static str {
        match self {
            Api::Registered => "registered",
            Api::Copy => "copy",
        }
    }
}

/// Errors of `kvpool bench store`.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum StoreBenchError {
    #[error("invalid arguments: {0}")]
    Args(String),
    #[error("cannot start {what}")]
    Spawn {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} exited early ({status}); last log lines:\n{log}")]
    ChildExited {
        what: String,
        status: String,
        log: String,
    },
    #[error("{what} did not become ready within {timeout:?}")]
    NotReady { what: String, timeout: Duration },
    #[error("I/O on the benchmark's files or pipes")]
    Io(#[source] std::io::Error),
    #[error("master call failed")]
    Master(#[source] ClientError),
    #[error("client set-up failed")]
    Client(#[source] transfer::TransferError),
    #[error("worker protocol: {0}")]
    Protocol(String),
    #[error("redis baseline failed: {0}")]
    Redis(String),
    #[error("a benchmark task was lost: {0}")]
    Join(String),
}

impl StoreBenchError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

// ----- plan (pure) ------------------------------------------------------------------------

/// One barrier-separated step every worker runs at the same time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Put(u64),
    Get(u64),
    Exists,
    Prefix,
    /// Drop the objects of a size (not timed) so the next size has room.
    Remove(u64),
}

impl Phase {
    pub fn name(self) -> String {
        match self {
            Phase::Put(s) => format!("put:{s}"),
            Phase::Get(s) => format!("get:{s}"),
            Phase::Exists => "exists".into(),
            Phase::Prefix => "prefix".into(),
            Phase::Remove(s) => format!("remove:{s}"),
        }
    }
}

/// The phases of a run: per size, `rounds` times put then get then remove (the pool's memory
/// bounds how much one round can hold); after the first size's first get, the metadata phases
/// over its (still committed) keys.
pub fn plan(sizes: &[u64], rounds: u32) -> Vec<Phase> {
    let mut out = Vec::new();
    for (i, &s) in sizes.iter().enumerate() {
        for r in 0..rounds {
            out.push(Phase::Put(s));
            out.push(Phase::Get(s));
            if i == 0 && r == 0 {
                out.push(Phase::Exists);
                out.push(Phase::Prefix);
            }
            out.push(Phase::Remove(s));
        }
    }
    out
}

impl StoreBenchArgs {
    /// Operations per client for values of `size` bytes.
    pub fn ops_for(&self, size: u64) -> u64 {
        self.ops.unwrap_or_else(|| {
            let per_client = self.bytes_per_size / size.max(1) / self.clients.max(1) as u64;
            per_client.max(self.depth as u64)
        })
    }

    fn validate(&self) -> Result<(), StoreBenchError> {
        let bad = |m: String| Err(StoreBenchError::Args(m));
        if self.agents == 0 || self.clients == 0 || self.depth == 0 {
            return bad("--agents, --clients and --depth must be > 0".into());
        }
        if self.sizes.is_empty() {
            return bad("--sizes needs at least one size".into());
        }
        if self.rounds == 0 {
            return bad("--rounds must be > 0".into());
        }
        if self.ops == Some(0) {
            return bad("--ops must be > 0".into());
        }
        if self.replicas == 0 || usize::from(self.replicas) > self.agents {
            return bad(format!(
                "--replicas {} must be between 1 and --agents ({})",
                self.replicas, self.agents
            ));
        }
        if self.batch == 0 || self.batch > 16_384 {
            return bad("--batch must be between 1 and 16384".into());
        }
        if self.lanes == 0 || self.lanes > 64 {
            return bad("--lanes must be between 1 and 64".into());
        }
        // Everything of one size is live at once; stay under the master's eviction watermark
        // (0.95) with some slack for allocation granularity.
        let total = self.agent_capacity.saturating_mul(self.agents as u64);
        for &s in &self.sizes {
            let need = self
                .ops_for(s)
                .saturating_mul(self.clients as u64)
                .saturating_mul(s.div_ceil(4096) * 4096)
                .saturating_mul(u64::from(self.replicas));
            if need > total / 10 * 9 {
                return bad(format!(
                    "values of {s} bytes need {need} bytes of pool DRAM but {} agents x \
                     --agent-capacity {} hold {total}; lower --bytes-per-size/--ops or raise \
                     --agent-capacity",
                    self.agents, self.agent_capacity
                ));
            }
            if s > self.agent_capacity {
                return bad(format!("value size {s} exceeds --agent-capacity"));
            }
        }
        Ok(())
    }
}

// ----- worker results and report (pure) --------------------------------------------------

/// What one worker reports for one phase.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct PhaseResult {
    /// Successful operations (calls, for the metadata phases).
    pub ops: u64,
    /// Value bytes moved by successful operations.
    pub bytes: u64,
    pub failures: u64,
    /// Gets whose bytes matched what was put.
    pub verified: u64,
    /// Gets that returned other bytes, or lookups that answered other than expected.
    pub mismatches: u64,
    pub first_error: Option<String>,
    /// Latency histogram (microseconds) as (value, count) pairs of its recorded buckets.
    pub latency_us: Vec<(u64, u64)>,
    /// Master calls the worker's client sent during the phase (coalesced get, put_start,
    /// put_end and lease releases).
    #[serde(default)]
    pub master_calls: u64,
}

/// Aggregated figures of one timed phase.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct PhaseFigures {
    pub ops: u64,
    pub failures: u64,
    pub seconds: f64,
    pub ops_per_second: f64,
    /// Decimal gigabytes (1e9 bytes) per second.
    pub gb_per_second: f64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub first_error: Option<String>,
    /// Master calls per operation (data phases; concurrent calls are coalesced).
    pub master_calls_per_op: f64,
}

/// One value size.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct SizeFigures {
    pub size_bytes: u64,
    pub put: PhaseFigures,
    pub get: PhaseFigures,
    /// Gets whose bytes were compared with what was put and matched.
    pub get_verified: u64,
    pub get_mismatches: u64,
}

/// Metadata lookups.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct LookupFigures {
    pub batch: usize,
    pub exists_calls_per_second: f64,
    pub exists_key_lookups_per_second: f64,
    pub prefix_calls_per_second: f64,
    pub prefix_key_lookups_per_second: f64,
    /// Calls that answered other than "all present" (every looked-up key was committed).
    pub mismatches: u64,
    pub failures: u64,
}

/// Redis baseline.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RedisFigures {
    pub value_bytes: u64,
    pub connections: u32,
    pub requests: u64,
    pub set_ops_per_second: f64,
    pub get_ops_per_second: f64,
    pub set_gb_per_second: f64,
    pub get_gb_per_second: f64,
}

/// Our 1 MiB throughput over Redis's.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Ratio {
    pub put_over_set: f64,
    pub get_over_get: f64,
}

/// The whole run.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct StoreBenchReport {
    pub agents: usize,
    pub clients: usize,
    pub depth: usize,
    pub replicas: u8,
    pub rounds: u32,
    pub api: Api,
    pub transport: &'static str,
    pub values: Vec<SizeFigures>,
    pub lookups: Option<LookupFigures>,
    /// Every get of every size returned exactly the bytes put.
    pub all_gets_verified: bool,
    pub redis: Option<RedisFigures>,
    /// Present when 1 MiB was measured and Redis ran.
    pub ratio_1mib: Option<Ratio>,
    pub load_average: Option<[f64; 3]>,
}

fn histogram() -> Histogram<u64> {
    // 1 µs to 10 min at 3 significant digits: constant, valid bounds.
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("constant histogram bounds are valid")
}

fn encode_histogram(h: &Histogram<u64>) -> Vec<(u64, u64)> {
    h.iter_recorded()
        .map(|v| (v.value_iterated_to(), v.count_at_value()))
        .collect()
}

/// Aggregate the workers' results of a phase that took `seconds` (barrier to last result).
pub fn aggregate(results: &[PhaseResult], seconds: f64) -> PhaseFigures {
    let mut h = histogram();
    let (mut ops, mut bytes, mut failures, mut calls) = (0u64, 0u64, 0u64, 0u64);
    let mut first_error = None;
    for r in results {
        ops += r.ops;
        bytes += r.bytes;
        failures += r.failures;
        calls += r.master_calls;
        if first_error.is_none() {
            first_error.clone_from(&r.first_error);
        }
        for &(v, c) in &r.latency_us {
            let _ = h.record_n(v.max(1), c);
        }
    }
    let secs = seconds.max(1e-9);
    PhaseFigures {
        ops,
        failures,
        seconds,
        ops_per_second: ops as f64 / secs,
        gb_per_second: bytes as f64 / secs / 1e9,
        p50_us: h.value_at_quantile(0.5),
        p99_us: h.value_at_quantile(0.99),
        first_error,
        master_calls_per_op: calls as f64 / ops.max(1) as f64,
    }
}

/// Parse `redis-benchmark --csv` output into (test name, requests per second) pairs.
/// Redis 7 prints a header row and quoted fields; rows whose second field is not a number
/// (the header) are skipped.
pub fn parse_redis_csv(out: &str) -> Vec<(String, f64)> {
    out.lines()
        .filter_map(|line| {
            let mut fields = line.split(',').map(|f| f.trim().trim_matches('"'));
            let name = fields.next()?.to_owned();
            let rps: f64 = fields.next()?.parse().ok()?;
            (!name.is_empty() && rps.is_finite()).then_some((name, rps))
        })
        .collect()
}

fn load_average() -> Option<[f64; 3]> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut it = s.split_whitespace().map(|v| v.parse::<f64>().ok());
    Some([it.next()??, it.next()??, it.next()??])
}

// ----- values (pure) ----------------------------------------------------------------------

/// Pseudo-random bytes (xorshift), so that nothing on the path can shortcut on zero pages or
/// repeated content.
pub fn template(size: u64, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..size)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn stamp(worker: usize, i: u64) -> [u8; STAMP] {
    let mut s = [0u8; STAMP];
    s[..8].copy_from_slice(&(worker as u64).to_le_bytes());
    s[8..].copy_from_slice(&i.to_le_bytes());
    s
}

/// Write the stamp of object `i` of `worker` over the start of `buf`.
fn stamp_into(buf: &mut [u8], worker: usize, i: u64) {
    let s = stamp(worker, i);
    let n = buf.len().min(STAMP);
    buf[..n].copy_from_slice(&s[..n]);
}

/// Whether the start of registered buffer `seg` holds the value of object `i` of `worker`,
/// compared in place (no copy out of the buffer first).
fn verify_segment(seg: &transfer::LocalSegment, tmpl: &[u8], worker: usize, i: u64) -> bool {
    let mem = seg.segment();
    if mem.check_range(0, tmpl.len() as u64).is_err() {
        return false;
    }
    // SAFETY: the range was checked to lie inside the segment's live mapping, which `seg` keeps
    // alive for the borrow. The buffer belongs to this benchmark task alone and the only writer,
    // the transport of its own `get_to`, has completed, so nothing writes these bytes while
    // the shared slice exists.
    let got = unsafe { std::slice::from_raw_parts(mem.addr() as *const u8, tmpl.len()) };
    verify(got, tmpl, worker, i)
}

/// Whether `got` is the value of object `i` of `worker` built on `tmpl`.
pub fn verify(got: &[u8], tmpl: &[u8], worker: usize, i: u64) -> bool {
    if got.len() != tmpl.len() {
        return false;
    }
    let s = stamp(worker, i);
    let n = got.len().min(STAMP);
    got[..n] == s[..n] && got[n..] == tmpl[n..]
}

fn object_key(worker: usize, size: u64, i: u64) -> Vec<u8> {
    format!("bench/w{worker}/s{size}/{i}").into_bytes()
}

// ----- worker process ---------------------------------------------------------------------

struct Worker {
    id: usize,
    args: StoreBenchArgs,
    pool: PoolClient,
    master: MasterClient,
}

impl Worker {
    async fn run_phase(&self, phase: Phase) -> PhaseResult {
        match phase {
            Phase::Put(s) => self.data_phase(s, true).await,
            Phase::Get(s) => self.data_phase(s, false).await,
            Phase::Exists => self.lookup_phase(false).await,
            Phase::Prefix => self.lookup_phase(true).await,
            Phase::Remove(s) => self.remove_phase(s).await,
        }
    }

    async fn data_phase(&self, size: u64, put: bool) -> PhaseResult {
        let ops = self.args.ops_for(size);
        let tmpl = Arc::new(template(size, 0x9e37_79b9 ^ size));
        let next = Arc::new(AtomicU64::new(0));
        let opts = PutOptions {
            replicas: self.args.replicas,
            ..PutOptions::default()
        };
        let mut tasks = Vec::new();
        let api = self.args.api;
        let before = self.master.batched_calls();
        for _ in 0..self.args.depth {
            let (pool, tmpl, next, opts) =
                (self.pool.clone(), tmpl.clone(), next.clone(), opts.clone());
            let id = self.id;
            tasks.push(tokio::spawn(async move {
                let mut r = PhaseResult::default();
                let mut h = histogram();
                let mut buf = tmpl.as_ref().clone();
                // Registered API: one registered buffer per task, holding the value to put or
                // receiving the value got.
                let registered = match api {
                    Api::Registered => match pool.register_buffer(size) {
                        Ok(b) => match b.segment().write_at(0, &tmpl) {
                            Ok(()) => Some(b),
                            Err(e) => return failed(&e),
                        },
                        Err(e) => return failed(&e),
                    },
                    Api::Copy => None,
                };
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= ops {
                        break;
                    }
                    let key = object_key(id, size, i);
                    let t = Instant::now();
                    let outcome: Result<bool, DataError> = match (put, &registered) {
                        (true, Some(reg)) => {
                            match reg
                                .segment()
                                .write_at(0, &stamp(id, i)[..STAMP.min(buf.len())])
                            {
                                Ok(()) => {
                                    pool.put_from(&key, reg, 0, size, &opts).await.map(|_| true)
                                }
                                Err(e) => Err(DataError::Staging { size, source: e }),
                            }
                        }
                        (true, None) => {
                            stamp_into(&mut buf, id, i);
                            pool.put(&key, &buf, &opts).await.map(|_| true)
                        }
                        (false, Some(reg)) => {
                            // Stale bytes from an earlier get must not pass for this one.
                            match reg
                                .segment()
                                .write_at(0, &[0u8; STAMP][..STAMP.min(buf.len())])
                            {
                                Ok(()) => pool
                                    .get_to(&key, reg, 0)
                                    .await
                                    .map(|n| n == size && verify_segment(reg, &tmpl, id, i)),
                                Err(e) => Err(DataError::Staging { size, source: e }),
                            }
                        }
                        (false, None) => pool.get(&key).await.map(|got| verify(&got, &tmpl, id, i)),
                    };
                    let _ = h.record(t.elapsed().as_micros().max(1) as u64);
                    match outcome {
                        Ok(ok) => {
                            r.ops += 1;
                            r.bytes += size;
                            if !put {
                                if ok {
                                    r.verified += 1;
                                } else {
                                    r.mismatches += 1;
                                }
                            }
                        }
                        Err(e) => {
                            r.failures += 1;
                            if r.first_error.is_none() {
                                r.first_error = Some(error_chain(&e));
                            }
                        }
                    }
                }
                r.latency_us = encode_histogram(&h);
                r
            }));
        }
        let mut r = merge(tasks).await;
        // Leases are released in the background; the phase ends when the master has them.
        self.pool.flush_releases().await;
        let after = self.master.batched_calls();
        r.master_calls = (after.get + after.put_start + after.put_end + after.release_leases)
            - (before.get + before.put_start + before.put_end + before.release_leases);
        r
    }

    async fn lookup_phase(&self, prefix: bool) -> PhaseResult {
        let Some(&size) = self.args.sizes.first() else {
            return PhaseResult::default();
        };
        let n = self.args.ops_for(size);
        let keys: Arc<Vec<Vec<u8>>> =
            Arc::new((0..n).map(|i| object_key(self.id, size, i)).collect());
        let stop = CancellationToken::new();
        let mut tasks = Vec::new();
        for d in 0..self.args.depth {
            let (master, keys, stop) = (self.master.clone(), keys.clone(), stop.clone());
            let batch = self.args.batch;
            tasks.push(tokio::spawn(async move {
                let mut r = PhaseResult::default();
                let mut h = histogram();
                let mut start = d * 7919;
                while !stop.is_cancelled() {
                    // A chain of `batch` committed keys (wrapping when fewer were put).
                    let chain: Vec<&[u8]> = (0..batch)
                        .filter_map(|j| keys.get((start + j) % keys.len().max(1)))
                        .map(Vec::as_slice)
                        .collect();
                    start = start.wrapping_add(104_729);
                    let t = Instant::now();
                    let ok = if prefix {
                        master
                            .longest_prefix(&chain)
                            .await
                            .map(|l| l == chain.len())
                    } else {
                        master.exists(&chain).await.map(|e| e.iter().all(|b| *b))
                    };
                    let _ = h.record(t.elapsed().as_micros().max(1) as u64);
                    match ok {
                        Ok(true) => r.ops += 1,
                        Ok(false) => {
                            r.ops += 1;
                            r.mismatches += 1;
                        }
                        Err(e) => {
                            r.failures += 1;
                            if r.first_error.is_none() {
                                r.first_error = Some(error_chain(&e));
                            }
                            // A dead master would spin here; one failure ends the task.
                            break;
                        }
                    }
                }
                r.latency_us = encode_histogram(&h);
                r
            }));
        }
        tokio::time::sleep(self.args.lookup_duration).await;
        stop.cancel();
        merge(tasks).await
    }

    async fn remove_phase(&self, size: u64) -> PhaseResult {
        let keys: Vec<Vec<u8>> = (0..self.args.ops_for(size))
            .map(|i| object_key(self.id, size, i))
            .collect();
        let mut r = PhaseResult::default();
        for chunk in keys.chunks(REMOVE_CHUNK) {
            let refs: Vec<&[u8]> = chunk.iter().map(Vec::as_slice).collect();
            match self.master.remove_batch(&refs).await {
                Ok(items) => {
                    for item in items {
                        match item {
                            Ok(()) => r.ops += 1,
                            Err(e) => {
                                r.failures += 1;
                                if r.first_error.is_none() {
                                    r.first_error = Some(error_chain(&e));
                                }
                            }
                        }
                    }
                }
                Err(e) => {
                    r.failures += chunk.len() as u64;
                    if r.first_error.is_none() {
                        r.first_error = Some(error_chain(&e));
                    }
                }
            }
        }
        r
    }
}

fn failed(e: &dyn std::error::Error) -> PhaseResult {
    PhaseResult {
        failures: 1,
        first_error: Some(error_chain(e)),
        ..PhaseResult::default()
    }
}

async fn merge(tasks: Vec<tokio::task::JoinHandle<PhaseResult>>) -> PhaseResult {
    let mut out = PhaseResult::default();
    let mut h = histogram();
    for t in tasks {
        let r = match t.await {
            Ok(r) => r,
            Err(e) => PhaseResult {
                failures: 1,
                first_error: Some(format!("task lost: {e}")),
                ..PhaseResult::default()
            },
        };
        out.ops += r.ops;
        out.bytes += r.bytes;
        out.failures += r.failures;
        out.verified += r.verified;
        out.mismatches += r.mismatches;
        if out.first_error.is_none() {
            out.first_error = r.first_error;
        }
        for (v, c) in r.latency_us {
            let _ = h.record_n(v.max(1), c);
        }
    }
    out.latency_us = encode_histogram(&h);
    out
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

fn read_key(path: &Path) -> Result<Vec<u8>, StoreBenchError> {
    std::fs::read(path).map_err(StoreBenchError::Io)
}

/// Body of a client process: connect, then for every phase of the plan print `READY <phase>`,
/// wait for `GO` on stdin, run it and print `RESULT <json>`.
async fn run_worker(id: usize, args: StoreBenchArgs) -> Result<(), StoreBenchError> {
    let (Some(master_addr), Some(key_file)) = (args.master, args.key_file.clone()) else {
        return Err(StoreBenchError::Args(
            "--worker needs --master and --key-file".into(),
        ));
    };
    let secret = read_key(&key_file)?;
    let key = MasterKey::from_bytes(&secret)
        .ok_or_else(|| StoreBenchError::Args("the key file holds too short a key".into()))?;
    let master = MasterClient::new(vec![master_addr.to_string()], key, ClientConfig::default())
        .map_err(StoreBenchError::Master)?;
    let node = format!("bench-client-{id}");
    let engine = TransferEngine::new(
        EngineConfig {
            node: node.clone(),
            lanes: args.lanes,
            // Clients and agents share this host; the benchmark measures the remote path.
            prefer_shm: false,
            ..EngineConfig::default()
        },
        transfer::AuthKey::new(secret).map_err(|e| StoreBenchError::Args(e.to_string()))?,
        Arc::new(StaticDirectory::new()),
        TransferMetrics::unregistered().map_err(|e| StoreBenchError::Args(e.to_string()))?,
    )
    .map_err(StoreBenchError::Client)?;
    let pool = PoolClient::new(master.clone(), engine, node, None);
    let worker = Worker {
        id,
        args: args.clone(),
        pool,
        master,
    };
    let stdin = std::io::stdin();
    let mut line = String::new();
    for phase in plan(&args.sizes, args.rounds) {
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "READY {}", phase.name()).map_err(StoreBenchError::Io)?;
            out.flush().map_err(StoreBenchError::Io)?;
        }
        line.clear();
        let n = tokio::task::block_in_place(|| stdin.lock().read_line(&mut line))
            .map_err(StoreBenchError::Io)?;
        if n == 0 {
            // The coordinator went away: stop quietly.
            return Ok(());
        }
        if line.trim() != "GO" {
            return Err(StoreBenchError::Protocol(format!(
                "expected GO, got {:?}",
                line.trim()
            )));
        }
        let result = worker.run_phase(phase).await;
        let json =
            serde_json::to_string(&result).map_err(|e| StoreBenchError::Protocol(e.to_string()))?;
        let mut out = std::io::stdout().lock();
        writeln!(out, "RESULT {json}").map_err(StoreBenchError::Io)?;
        out.flush().map_err(StoreBenchError::Io)?;
    }
    Ok(())
}

// ----- coordinator ------------------------------------------------------------------------

/// A child process killed when dropped, with its log file.
struct Proc {
    what: String,
    child: Child,
    log: PathBuf,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    fn spawn(what: String, cmd: &mut Command, log: PathBuf) -> Result<Self, StoreBenchError> {
        let file = std::fs::File::create(&log).map_err(StoreBenchError::Io)?;
        let child =
            cmd.stderr(Stdio::from(file))
                .spawn()
                .map_err(|source| StoreBenchError::Spawn {
                    what: what.clone(),
                    source,
                })?;
        Ok(Self { what, child, log })
    }

    fn check_running(&mut self) -> Result<(), StoreBenchError> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(self.exited(status.to_string())),
            Err(e) => Err(StoreBenchError::Io(e)),
        }
    }

    fn exited(&self, status: String) -> StoreBenchError {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        StoreBenchError::ChildExited {
            what: self.what.clone(),
            status,
            log: tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
        }
    }
}

/// A worker process and its pipes.
struct WorkerProc {
    proc: Proc,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl WorkerProc {
    fn read_line(&mut self, prefix: &str) -> Result<String, StoreBenchError> {
        let mut line = String::new();
        let n = self
            .stdout
            .read_line(&mut line)
            .map_err(StoreBenchError::Io)?;
        if n == 0 {
            let status = self
                .proc
                .child
                .wait()
                .map_or_else(|e| e.to_string(), |s| s.to_string());
            return Err(self.proc.exited(status));
        }
        line.trim_end()
            .strip_prefix(prefix)
            .map(str::to_owned)
            .ok_or_else(|| {
                StoreBenchError::Protocol(format!(
                    "{} said {:?}, expected {prefix:?}",
                    self.proc.what,
                    line.trim_end()
                ))
            })
    }
}

fn loopback_port() -> Result<SocketAddr, StoreBenchError> {
    let port = free_port().map_err(|e| StoreBenchError::Args(e.to_string()))?;
    Ok(SocketAddr::from(([127, 0, 0, 1], port)))
}

fn start_master(
    exe: &Path,
    dir: &Path,
    key_file: &Path,
) -> Result<(Proc, SocketAddr), StoreBenchError> {
    let grpc = loopback_port()?;
    let admin = loopback_port()?;
    let mut cmd = Command::new(exe);
    cmd.args(["master", "--listen", &grpc.to_string()])
        .args(["--admin-addr", &admin.to_string()])
        .arg("--auth-key-file")
        .arg(key_file)
        // A loaded box must not declare agents dead in the middle of a phase.
        .args(["--heartbeat-timeout", "30s", "--put-timeout", "120s"])
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    let mut proc = Proc::spawn("kvpool master".into(), &mut cmd, dir.join("master.log"))?;
    let deadline = Instant::now() + START_TIMEOUT;
    while !wait_for_port(grpc, Duration::from_millis(500)) {
        proc.check_running()?;
        if Instant::now() > deadline {
            return Err(StoreBenchError::NotReady {
                what: "kvpool master".into(),
                timeout: START_TIMEOUT,
            });
        }
    }
    Ok((proc, grpc))
}

/// `MemTotal` and `MemAvailable` of /proc/meminfo, in kB.
fn host_memory_kb() -> Result<(u64, u64), StoreBenchError> {
    let text = std::fs::read_to_string("/proc/meminfo").map_err(StoreBenchError::Io)?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse()
                    .ok()
            })
            .ok_or_else(|| StoreBenchError::Args(format!("/proc/meminfo has no {name}")))
    };
    Ok((field("MemTotal:")?, field("MemAvailable:")?))
}

/// A machine description for the agents: one NUMA node with every online CPU and this host's
/// memory, free = MemAvailable. Returns the (sysfs, procfs) roots.
fn write_topology(dir: &Path) -> Result<(PathBuf, PathBuf), StoreBenchError> {
    let (total, available) = host_memory_kb()?;
    let cpus =
        std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_else(|_| "0\n".into());
    let sys = dir.join("topology/sys");
    let proc = dir.join("topology/proc");
    let node = sys.join("devices/system/node/node0");
    for d in [
        &node,
        &sys.join("devices/system/cpu"),
        &sys.join("bus/pci/devices"),
        &proc,
    ] {
        std::fs::create_dir_all(d).map_err(StoreBenchError::Io)?;
    }
    let used = total.saturating_sub(available);
    let files = [
        (
            node.join("meminfo"),
            format!(
                "Node 0 MemTotal: {total} kB\nNode 0 MemFree: {available} kB\nNode 0 MemUsed: {used} kB\n"
            ),
        ),
        (node.join("cpulist"), cpus.clone()),
        (sys.join("devices/system/cpu/online"), cpus),
        (
            proc.join("meminfo"),
            format!(
                "MemTotal: {total} kB\nMemFree: {available} kB\nMemAvailable: {available} kB\n"
            ),
        ),
    ];
    for (path, text) in files {
        std::fs::write(path, text).map_err(StoreBenchError::Io)?;
    }
    Ok((sys, proc))
}

fn start_agent(
    bin: &Path,
    dir: &Path,
    i: usize,
    master: SocketAddr,
    key_file: &Path,
    capacity: u64,
    topology: Option<&(PathBuf, PathBuf)>,
) -> Result<Proc, StoreBenchError> {
    let name = format!("bench-agent-{i}");
    let own = dir.join(&name);
    std::fs::create_dir_all(own.join("run")).map_err(StoreBenchError::Io)?;
    let discovery = topology.map_or_else(String::new, |(sys, proc)| {
        format!(
            "discovery:\n  sysfs_root: {}\n  procfs_root: {}\n",
            sys.display(),
            proc.display()
        )
    });
    let cfg = format!(
        "node_name: {name}\n{discovery}\
         dram:\n  capacity: {capacity}\n  lock: false\n\
         engine_api:\n  socket_dir: {run}\n  shm_dir: {run}\n\
         admin:\n  listen: 127.0.0.1:0\n\
         pool:\n  master: [\"{master}\"]\n  auth_key_file: {key}\n  transport_listen: 127.0.0.1:0\n  heartbeat_interval: 1s\n",
        run = own.join("run").display(),
        key = key_file.display(),
    );
    let path = own.join("agent.yaml");
    std::fs::write(&path, cfg).map_err(StoreBenchError::Io)?;
    let mut cmd = Command::new(bin);
    cmd.args(["agent", "run", "--config"])
        .arg(&path)
        .env_remove("KVPOOL_MASTER")
        .env_remove("KVPOOL_AUTH_KEY_FILE")
        .env_remove("POD_IP")
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    Proc::spawn(name.clone(), &mut cmd, dir.join(format!("{name}.log")))
}

fn start_worker(
    exe: &Path,
    dir: &Path,
    id: usize,
    args: &StoreBenchArgs,
    master: SocketAddr,
    key_file: &Path,
) -> Result<WorkerProc, StoreBenchError> {
    let sizes: Vec<String> = args.sizes.iter().map(u64::to_string).collect();
    let mut cmd = Command::new(exe);
    cmd.args(["bench", "store", "--worker", &id.to_string()])
        .args(["--master", &master.to_string()])
        .arg("--key-file")
        .arg(key_file)
        .args(["--agents", &args.agents.to_string()])
        .args(["--clients", &args.clients.to_string()])
        .args(["--depth", &args.depth.to_string()])
        .args(["--sizes", &sizes.join(",")])
        .args(["--bytes-per-size", &args.bytes_per_size.to_string()])
        .args(["--rounds", &args.rounds.to_string()])
        .args(["--replicas", &args.replicas.to_string()])
        .args(["--lanes", &args.lanes.to_string()])
        .args(["--api", args.api.as_str()])
        .args(["--batch", &args.batch.to_string()])
        .args([
            "--lookup-duration",
            &format!("{}ms", args.lookup_duration.as_millis()),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    if let Some(ops) = args.ops {
        cmd.args(["--ops", &ops.to_string()]);
    }
    let mut proc = Proc::spawn(
        format!("client {id}"),
        &mut cmd,
        dir.join(format!("client-{id}.log")),
    )?;
    let (Some(stdin), Some(stdout)) = (proc.child.stdin.take(), proc.child.stdout.take()) else {
        return Err(StoreBenchError::Protocol("client pipes missing".into()));
    };
    Ok(WorkerProc {
        proc,
        stdin,
        stdout: BufReader::new(stdout),
    })
}

async fn wait_for_agents(
    client: &MasterClient,
    agents: &mut [Proc],
    master: &mut Proc,
    want: usize,
) -> Result<(), StoreBenchError> {
    let started = Instant::now();
    loop {
        master.check_running()?;
        for a in agents.iter_mut() {
            a.check_running()?;
        }
        if let Ok(s) = client.stats().await
            && s.nodes_alive >= want as u64
            && s.segments >= want as u64
        {
            return Ok(());
        }
        if started.elapsed() > START_TIMEOUT {
            return Err(StoreBenchError::NotReady {
                what: format!("{want} agents mounted at the master"),
                timeout: START_TIMEOUT,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Run every phase across the workers; returns (phase, results, seconds) per phase.
fn drive(
    workers: &mut [WorkerProc],
    phases: &[Phase],
) -> Result<Vec<(Phase, Vec<PhaseResult>, f64)>, StoreBenchError> {
    let mut out = Vec::new();
    for &phase in phases {
        let name = phase.name();
        for w in workers.iter_mut() {
            let got = w.read_line("READY ")?;
            if got != name {
                return Err(StoreBenchError::Protocol(format!(
                    "{} is ready for {got}, expected {name}",
                    w.proc.what
                )));
            }
        }
        let started = Instant::now();
        for w in workers.iter_mut() {
            writeln!(w.stdin, "GO")
                .and_then(|()| w.stdin.flush())
                .map_err(StoreBenchError::Io)?;
        }
        let mut results = Vec::new();
        for w in workers.iter_mut() {
            let json = w.read_line("RESULT ")?;
            let r: PhaseResult = serde_json::from_str(&json).map_err(|e| {
                StoreBenchError::Protocol(format!("{}: bad result {json:?}: {e}", w.proc.what))
            })?;
            results.push(r);
        }
        out.push((phase, results, started.elapsed().as_secs_f64()));
    }
    Ok(out)
}

/// Start `redis-server` on a free loopback port and run `redis-benchmark` against it.
fn redis_baseline(dir: &Path, requests: u64) -> Result<RedisFigures, StoreBenchError> {
    const VALUE: u64 = 1 << 20;
    const CONNECTIONS: u32 = 4;
    let addr = loopback_port()?;
    let port = addr.port().to_string();
    let mut cmd = Command::new("redis-server");
    cmd.args(["--port", &port, "--bind", "127.0.0.1", "--save", ""])
        .args(["--appendonly", "no", "--protected-mode", "no"])
        .arg("--dir")
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    let mut server =
        Proc::spawn("redis-server".into(), &mut cmd, dir.join("redis.log")).map_err(|e| {
            StoreBenchError::Redis(format!("{e} (install the Debian package redis-server)"))
        })?;
    let deadline = Instant::now() + START_TIMEOUT;
    while !wait_for_port(addr, Duration::from_millis(500)) {
        server.check_running()?;
        if Instant::now() > deadline {
            return Err(StoreBenchError::Redis("redis-server never listened".into()));
        }
    }
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port])
        .args(["-d", &VALUE.to_string(), "-c", &CONNECTIONS.to_string()])
        .args(["-t", "set,get", "-n", &requests.to_string(), "--csv"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| StoreBenchError::Redis(format!("running redis-benchmark: {e}")))?;
    drop(server);
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(StoreBenchError::Redis(format!(
            "redis-benchmark exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let rows = parse_redis_csv(&text);
    let rps = |name: &str| {
        rows.iter()
            .find(|(n, _)| n == name)
            .map(|(_, r)| *r)
            .ok_or_else(|| StoreBenchError::Redis(format!("no {name} row in {text:?}")))
    };
    let (set, get) = (rps("SET")?, rps("GET")?);
    Ok(RedisFigures {
        value_bytes: VALUE,
        connections: CONNECTIONS,
        requests,
        set_ops_per_second: set,
        get_ops_per_second: get,
        set_gb_per_second: set * VALUE as f64 / 1e9,
        get_gb_per_second: get * VALUE as f64 / 1e9,
    })
}

/// Build the report from the phases' results (pure).
pub fn report(
    args: &StoreBenchArgs,
    phases: &[(Phase, Vec<PhaseResult>, f64)],
    redis: Option<RedisFigures>,
) -> StoreBenchReport {
    let find = |want: Phase| phases.iter().find(|(p, _, _)| *p == want);
    // Every round of a phase: all workers' results and the summed barrier-to-barrier time.
    let rounds = |want: Phase| -> Option<(Vec<PhaseResult>, f64)> {
        let matching: Vec<_> = phases.iter().filter(|(p, _, _)| *p == want).collect();
        (!matching.is_empty()).then(|| {
            (
                matching
                    .iter()
                    .flat_map(|(_, r, _)| r.iter().cloned())
                    .collect(),
                matching.iter().map(|(_, _, t)| t).sum(),
            )
        })
    };
    let mut values = Vec::new();
    let mut all_verified = true;
    for &s in &args.sizes {
        let put = rounds(Phase::Put(s))
            .map(|(r, t)| aggregate(&r, t))
            .unwrap_or_default();
        let (get, verified, mismatches) = rounds(Phase::Get(s)).map_or_else(
            || (PhaseFigures::default(), 0, 0),
            |(r, t)| {
                (
                    aggregate(&r, t),
                    r.iter().map(|x| x.verified).sum(),
                    r.iter().map(|x| x.mismatches).sum(),
                )
            },
        );
        let expected = args.ops_for(s) * args.clients as u64 * u64::from(args.rounds);
        all_verified &= verified == expected && mismatches == 0;
        values.push(SizeFigures {
            size_bytes: s,
            put,
            get,
            get_verified: verified,
            get_mismatches: mismatches,
        });
    }
    let lookups = match (find(Phase::Exists), find(Phase::Prefix)) {
        (Some((_, e, te)), Some((_, p, tp))) => {
            let ea = aggregate(e, *te);
            let pa = aggregate(p, *tp);
            Some(LookupFigures {
                batch: args.batch,
                exists_calls_per_second: ea.ops_per_second,
                exists_key_lookups_per_second: ea.ops_per_second * args.batch as f64,
                prefix_calls_per_second: pa.ops_per_second,
                prefix_key_lookups_per_second: pa.ops_per_second * args.batch as f64,
                mismatches: e.iter().chain(p).map(|r| r.mismatches).sum(),
                failures: ea.failures + pa.failures,
            })
        }
        _ => None,
    };
    let ratio_1mib = redis.as_ref().and_then(|r| {
        let v = values.iter().find(|v| v.size_bytes == r.value_bytes)?;
        Some(Ratio {
            put_over_set: v.put.ops_per_second / r.set_ops_per_second.max(1e-9),
            get_over_get: v.get.ops_per_second / r.get_ops_per_second.max(1e-9),
        })
    });
    StoreBenchReport {
        agents: args.agents,
        clients: args.clients,
        depth: args.depth,
        replicas: args.replicas,
        rounds: args.rounds,
        api: args.api,
        transport: "tcp",
        values,
        lookups,
        all_gets_verified: all_verified,
        redis,
        ratio_1mib,
        load_average: load_average(),
    }
}

async fn coordinate(args: StoreBenchArgs) -> Result<StoreBenchReport, StoreBenchError> {
    args.validate()?;
    let exe = std::env::current_exe().map_err(StoreBenchError::Io)?;
    let dir = tempfile::tempdir().map_err(StoreBenchError::Io)?;
    let key_file = dir.path().join("pool.key");
    let secret = format!(
        "{:032x}{:032x}",
        rand::random::<u128>(),
        rand::random::<u128>()
    );
    std::fs::write(&key_file, &secret).map_err(StoreBenchError::Io)?;
    let key = MasterKey::from_bytes(secret.as_bytes())
        .ok_or_else(|| StoreBenchError::Args("generated key too short".into()))?;

    let (mut master, grpc) = start_master(&exe, dir.path(), &key_file)?;
    let topology = if args.host_topology {
        None
    } else {
        Some(write_topology(dir.path())?)
    };
    let mut agents = (0..args.agents)
        .map(|i| {
            start_agent(
                &exe,
                dir.path(),
                i,
                grpc,
                &key_file,
                args.agent_capacity,
                topology.as_ref(),
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let client = MasterClient::new(vec![grpc.to_string()], key, ClientConfig::default())
        .map_err(StoreBenchError::Master)?;
    wait_for_agents(&client, &mut agents, &mut master, args.agents).await?;

    let mut workers = (0..args.clients)
        .map(|id| start_worker(&exe, dir.path(), id, &args, grpc, &key_file))
        .collect::<Result<Vec<_>, _>>()?;
    let phases = plan(&args.sizes, args.rounds);
    let results = tokio::task::block_in_place(|| drive(&mut workers, &phases))?;
    for w in &mut workers {
        // Closing stdin ends the worker; drop kills whatever is left.
        let _ = w.proc.child.wait();
    }
    drop(workers);
    drop(agents);
    drop(master);

    let redis = if args.no_redis {
        None
    } else {
        Some(redis_baseline(dir.path(), args.redis_requests)?)
    };
    Ok(report(&args, &results, redis))
}

fn print_text(r: &StoreBenchReport) {
    println!(
        "{} agents, {} client processes x {} in flight, {} replica(s), transport {}, {} API",
        r.agents,
        r.clients,
        r.depth,
        r.replicas,
        r.transport,
        r.api.as_str()
    );
    for v in &r.values {
        for (what, f) in [("put", &v.put), ("get", &v.get)] {
            println!(
                "{what} {:>8} B  {:>9.0} ops/s  {:>6.2} GB/s  p50 {:>6} us  p99 {:>6} us  \
                 master calls/op {:.2}  failures {}",
                v.size_bytes,
                f.ops_per_second,
                f.gb_per_second,
                f.p50_us,
                f.p99_us,
                f.master_calls_per_op,
                f.failures
            );
        }
        println!(
            "    verified gets {} / mismatches {}",
            v.get_verified, v.get_mismatches
        );
    }
    if let Some(l) = &r.lookups {
        println!(
            "exists x{}          {:.0} calls/s = {:.0} key lookups/s",
            l.batch, l.exists_calls_per_second, l.exists_key_lookups_per_second
        );
        println!(
            "longest_prefix x{}  {:.0} calls/s = {:.0} key lookups/s",
            l.batch, l.prefix_calls_per_second, l.prefix_key_lookups_per_second
        );
    }
    if let Some(x) = &r.redis {
        println!(
            "redis 1 MiB x{} conns: SET {:.0} ops/s ({:.2} GB/s), GET {:.0} ops/s ({:.2} GB/s)",
            x.connections,
            x.set_ops_per_second,
            x.set_gb_per_second,
            x.get_ops_per_second,
            x.get_gb_per_second
        );
    }
    if let Some(q) = &r.ratio_1mib {
        println!(
            "1 MiB vs redis: put/SET {:.2}x, get/GET {:.2}x",
            q.put_over_set, q.get_over_get
        );
    }
    println!("all gets verified: {}", r.all_gets_verified);
}

/// Entry point of `kvpool bench store` (coordinator or, with `--worker`, a client process).
pub fn run(args: StoreBenchArgs) -> Result<(), StoreBenchError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(StoreBenchError::Io)?;
    if let Some(id) = args.worker {
        return rt.block_on(run_worker(id, args));
    }
    let json = args.json;
    let r = rt.block_on(coordinate(args))?;
    if json {
        let text = serde_json::to_string_pretty(&r)
            .map_err(|e| StoreBenchError::Protocol(e.to_string()))?;
        println!("{text}");
    } else {
        print_text(&r);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        args: StoreBenchArgs,
    }

    fn args(extra: &[&str]) -> StoreBenchArgs {
        let mut v = vec!["x"];
        v.extend_from_slice(extra);
        Wrap::parse_from(v).args
    }

    #[test]
    fn plan_puts_gets_then_looks_up_the_first_size_and_removes_each() {
        let p = plan(&[10, 20], 1);
        assert_eq!(
            p,
            vec![
                Phase::Put(10),
                Phase::Get(10),
                Phase::Exists,
                Phase::Prefix,
                Phase::Remove(10),
                Phase::Put(20),
                Phase::Get(20),
                Phase::Remove(20),
            ]
        );
        assert_eq!(Phase::Put(65536).name(), "put:65536");
        assert!(plan(&[], 3).is_empty());
        let two = plan(&[10], 2);
        assert_eq!(two.len(), 8, "{two:?}");
        assert_eq!(
            two.iter().filter(|p| **p == Phase::Exists).count(),
            1,
            "lookups run once"
        );
    }

    #[test]
    fn ops_follow_the_byte_budget_with_a_floor_of_depth() {
        let a = args(&[
            "--bytes-per-size",
            "64MiB",
            "--clients",
            "2",
            "--depth",
            "3",
        ]);
        assert_eq!(a.ops_for(1 << 20), 32);
        assert_eq!(a.ops_for(64 << 20), 3, "at least one op per task");
        let b = args(&["--ops", "5"]);
        assert_eq!(b.ops_for(1 << 20), 5);
        assert_eq!(a.sizes, vec![64 << 10, 1 << 20, 4 << 20]);
    }

    #[test]
    fn bad_arguments_are_named() {
        let msg = |a: StoreBenchArgs| match a.validate() {
            Err(StoreBenchError::Args(m)) => m,
            other => panic!("expected an argument error, got {other:?}"),
        };
        assert!(msg(args(&["--replicas", "3", "--agents", "2"])).contains("--replicas"));
        assert!(msg(args(&["--clients", "0"])).contains("--clients"));
        assert!(msg(args(&["--batch", "0"])).contains("--batch"));
        // More than the agents hold.
        let m = msg(args(&[
            "--bytes-per-size",
            "4GiB",
            "--agent-capacity",
            "1GiB",
        ]));
        assert!(m.contains("--agent-capacity"), "{m}");
        assert!(args(&[]).validate().is_ok(), "defaults are valid");
    }

    #[test]
    fn redis_csv_rows_are_parsed_and_the_header_skipped() {
        let out = "\"test\",\"rps\",\"avg_latency_ms\"\n\"SET\",\"1422.48\",\"2.053\"\n\
                   \"GET\",\"1501.50\",\"1.500\"\n";
        assert_eq!(
            parse_redis_csv(out),
            vec![("SET".to_owned(), 1422.48), ("GET".to_owned(), 1501.5)]
        );
        // Redis 6 style rows without a header.
        assert_eq!(
            parse_redis_csv("\"SET\",\"10.5\"\n"),
            vec![("SET".to_owned(), 10.5)]
        );
        assert!(parse_redis_csv("garbage\n\"SET\",\"x\"\n").is_empty());
    }

    #[test]
    fn values_verify_only_against_their_own_stamp_and_template() {
        let t = template(100, 7);
        assert_ne!(t, template(100, 8));
        let mut v = t.clone();
        stamp_into(&mut v, 3, 42);
        assert!(verify(&v, &t, 3, 42));
        assert!(!verify(&v, &t, 3, 43), "another object's stamp");
        assert!(!verify(&v, &t, 2, 42), "another worker's stamp");
        let mut bad = v.clone();
        bad[99] ^= 1;
        assert!(!verify(&bad, &t, 3, 42), "a flipped byte past the stamp");
        assert!(!verify(&v[..99], &t, 3, 42), "a short read");
        // Values shorter than the stamp still verify.
        let t4 = template(4, 1);
        let mut v4 = t4.clone();
        stamp_into(&mut v4, 1, 2);
        assert!(verify(&v4, &t4, 1, 2));
    }

    #[test]
    fn aggregate_sums_workers_and_merges_latencies() {
        let a = PhaseResult {
            ops: 10,
            bytes: 10_000,
            latency_us: vec![(100, 9), (1000, 1)],
            ..PhaseResult::default()
        };
        let b = PhaseResult {
            ops: 10,
            bytes: 10_000,
            failures: 1,
            first_error: Some("boom".into()),
            latency_us: vec![(100, 10)],
            ..PhaseResult::default()
        };
        let f = aggregate(&[a, b], 2.0);
        assert_eq!(f.ops, 20);
        assert_eq!(f.failures, 1);
        assert!((f.ops_per_second - 10.0).abs() < 1e-9);
        assert!((f.gb_per_second - 10_000.0 / 1e9).abs() < 1e-15);
        assert_eq!(f.first_error.as_deref(), Some("boom"));
        assert!((100..=101).contains(&f.p50_us), "p50 {}", f.p50_us);
        assert!(f.p99_us >= 999, "p99 {}", f.p99_us);
    }

    #[test]
    fn report_counts_verified_gets_and_computes_the_redis_ratio() {
        let a = args(&[
            "--sizes",
            "1MiB",
            "--ops",
            "2",
            "--clients",
            "2",
            "--rounds",
            "1",
        ]);
        let ok = |verified| PhaseResult {
            ops: 2,
            bytes: 2 << 20,
            verified,
            ..PhaseResult::default()
        };
        let phases = vec![
            (Phase::Put(1 << 20), vec![ok(0), ok(0)], 1.0),
            (Phase::Get(1 << 20), vec![ok(2), ok(2)], 0.5),
            (Phase::Exists, vec![ok(0)], 1.0),
            (Phase::Prefix, vec![ok(0)], 2.0),
        ];
        let redis = RedisFigures {
            value_bytes: 1 << 20,
            connections: 4,
            requests: 10,
            set_ops_per_second: 2.0,
            get_ops_per_second: 4.0,
            set_gb_per_second: 0.0,
            get_gb_per_second: 0.0,
        };
        let r = report(&a, &phases, Some(redis));
        assert!(r.all_gets_verified);
        let q = r.ratio_1mib.expect("ratio");
        assert!((q.put_over_set - 2.0).abs() < 1e-9);
        assert!((q.get_over_get - 2.0).abs() < 1e-9);
        let l = r.lookups.expect("lookups");
        assert!((l.exists_key_lookups_per_second - 200.0).abs() < 1e-9);
        assert!((l.prefix_key_lookups_per_second - 100.0).abs() < 1e-9);
        // Two rounds: the figures cover both, and both must be verified.
        let a2 = args(&[
            "--sizes",
            "1MiB",
            "--ops",
            "2",
            "--clients",
            "2",
            "--rounds",
            "2",
        ]);
        let mut twice = phases.clone();
        twice.push((Phase::Put(1 << 20), vec![ok(0), ok(0)], 1.0));
        twice.push((Phase::Get(1 << 20), vec![ok(2), ok(2)], 0.5));
        let r2 = report(&a2, &twice, None);
        assert!(r2.all_gets_verified);
        assert_eq!(r2.values[0].put.ops, 8);
        assert!((r2.values[0].put.ops_per_second - 4.0).abs() < 1e-9);
        assert!(
            !report(&a2, &phases, None).all_gets_verified,
            "a missing round"
        );
        // One get fewer verified: the run is not fully verified.
        let mut short = phases.clone();
        short[1].1[1].verified = 1;
        assert!(!report(&a, &short, None).all_gets_verified);
    }
}
